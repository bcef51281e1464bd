// Recovery through the optimizer port: a restore gives back parameters, optimizer state and RNG
// bitwise, training continued from it repeats the original run bitwise, a damaged copy is
// dropped for the next older one, a restore that does not fit changes nothing, and the guard
// rolls back as its policy says. Snapshots are copied in the background: step() returns before
// the copy runs, the next step and a restore wait for it, and a copy that fails is reported as a
// snapshot that could not be taken. A gate holds the copies: nothing here depends on timing.
#include <gtest/gtest.h>
#include <stepguard/stepguard.h>
#include <torch/torch.h>

#include <limits>
#include <thread>

#include "csrc/consensus/consensus.h"
#include "plugin/src/libtorch_port.h"
#include "plugin/src/recovery.h"
#include "tests/support/gate.h"
#include "tests/support/model_fixture.h"

namespace stepguard {
namespace {

void train_step(torch::nn::Sequential& model, torch::optim::Optimizer& opt, std::int64_t batch) {
  opt.zero_grad();
  // Dropout-like randomness from the global generator, so the RNG state matters.
  auto loss = loss_of(model, batch) * (1.0 + 0.01 * torch::rand({1}).item<double>());
  loss.backward();
  opt.step();
}

// One rank's recovery over a LibTorch optimizer, keeping `keep` RAM snapshots.
struct Rig {
  Rig(torch::optim::Optimizer& opt, std::int64_t keep)
      : port(opt, torch::OrderedDict<std::string, torch::Tensor>()),
        recovery(one_rank, port, config(keep)) {}
  static RecoveryConfig config(std::int64_t keep) {
    RecoveryConfig c;
    c.snapshot_every = 1;
    c.snapshot_keep = keep;
    return c;
  }
  LibTorchPort port;
  consensus::LocalConsensus one_rank;
  Recovery recovery;
};

template <typename Optimizer, typename Options>
void restore_reproduces_the_next_20_steps(Options options) {
  auto model = make_model(3);
  Optimizer opt(model->parameters(), options);
  for (std::int64_t b = 0; b < 5; ++b) train_step(model, opt, b);
  Rig rig(opt, 2);
  rig.recovery.take_snapshot(5, {});
  torch::manual_seed(77);  // the RNG state the snapshot saw is the one after this
  rig.recovery.take_snapshot(6, {});
  const auto params_at_6 = clone_all(model->parameters());
  std::vector<std::vector<torch::Tensor>> first_run;
  for (std::int64_t b = 6; b < 26; ++b) {
    train_step(model, opt, b);
    first_run.push_back(clone_all(model->parameters()));
  }
  rig.recovery.restore_snapshot(6);
  for (std::size_t i = 0; i < params_at_6.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(model->parameters()[i], params_at_6[i])) << i;
  }
  for (std::int64_t b = 6; b < 26; ++b) {
    train_step(model, opt, b);
    const auto params = model->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(bitwise_equal(params[i], first_run[static_cast<std::size_t>(b - 6)][i]))
          << "step " << b << ", parameter " << i;
    }
  }
}

TEST(Recovery, AdamWRestoreReproducesTheNext20StepsBitwise) {
  restore_reproduces_the_next_20_steps<torch::optim::AdamW>(
      torch::optim::AdamWOptions(1e-2).amsgrad(true));
}
TEST(Recovery, SgdWithMomentumRestoreReproducesTheNext20StepsBitwise) {
  restore_reproduces_the_next_20_steps<torch::optim::SGD>(
      torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true));
}
TEST(Recovery, RmspropRestoreReproducesTheNext20StepsBitwise) {
  restore_reproduces_the_next_20_steps<torch::optim::RMSprop>(
      torch::optim::RMSpropOptions(1e-3).momentum(0.5).centered(true));
}
TEST(Recovery, AdagradRestoreReproducesTheNext20StepsBitwise) {
  restore_reproduces_the_next_20_steps<torch::optim::Adagrad>(torch::optim::AdagradOptions(0.05));
}

TEST(Recovery, ASnapshotSurvivesItsRestoreForTheNextOne) {
  auto model = make_model(4);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  train_step(model, opt, 0);
  Rig rig(opt, 1);
  rig.recovery.take_snapshot(1, {});
  const auto at_1 = clone_all(model->parameters());
  const auto state_at_1 = adamw_state(opt);
  for (int round = 0; round < 2; ++round) {
    train_step(model, opt, 1);
    train_step(model, opt, 2);
    rig.recovery.restore_snapshot(1);
    for (std::size_t i = 0; i < at_1.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(model->parameters()[i], at_1[i]));
    }
    const auto state = adamw_state(opt);
    ASSERT_EQ(state.size(), state_at_1.size());
    for (std::size_t i = 0; i < state.size(); ++i)
      EXPECT_TRUE(bitwise_equal(state[i], state_at_1[i]));
  }
}

TEST(Recovery, ARestoreBeforeTheFirstStepRebuildsTheOptimizerState) {
  // The snapshot holds AdamW moments; the optimizer of a fresh process has none yet.
  auto model = make_model(13);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  train_step(model, opt, 0);
  Rig rig(opt, 1);
  rig.recovery.take_snapshot(1, {});
  const auto state_at_1 = adamw_state(opt);
  opt.state().clear();
  rig.recovery.restore_snapshot(1);
  const auto state = adamw_state(opt);
  ASSERT_EQ(state.size(), state_at_1.size());
  for (std::size_t i = 0; i < state.size(); ++i)
    EXPECT_TRUE(bitwise_equal(state[i], state_at_1[i]));
}

TEST(Recovery, ACorruptedCopyIsDroppedAndTheNextOlderOneIsUsed) {
  auto model = make_model(12);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  Rig rig(opt, 3);
  for (std::int64_t step : {2, 4}) {
    train_step(model, opt, step);
    rig.recovery.take_snapshot(step, {step});
    rig.recovery.on_step(step + 1, true);  // a clean next step confirms it
  }
  // A bit flip in host memory of the newest copy.
  auto* newest = const_cast<checkpoint::Snapshot*>(rig.recovery.ring()->at(4));
  newest->tensors[1].tensor.view(-1)[3].add_(1.0f);
  const std::optional<RollbackTarget> target = rig.recovery.roll_back(6, false);
  ASSERT_TRUE(target.has_value());
  EXPECT_EQ(target->step, 2);
  EXPECT_EQ(target->words, std::vector<std::int64_t>({2}));
  EXPECT_EQ(rig.recovery.snapshots_held(), 1u);  // the damaged one is gone, from the book too
  // With every copy damaged, a rollback cannot happen: the run must stop.
  auto* older = const_cast<checkpoint::Snapshot*>(rig.recovery.ring()->at(2));
  older->tensors[0].tensor.view(-1)[0].add_(1.0f);
  EXPECT_THROW(rig.recovery.roll_back(7, false), RollbackFailure);
}

// begin_snapshot() returns while the copy waits at the gate; a restore called then waits for the
// copy, and the snapshot gives back the state it was taken from, bitwise.
TEST(Recovery, ARestoreWaitsForTheSnapshotInFlight) {
  auto model = make_model(17);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  for (std::int64_t b = 0; b < 3; ++b) train_step(model, opt, b);
  Rig rig(opt, 2);
  const auto params_at_3 = clone_all(model->parameters());
  const auto adam_at_3 = adamw_state(opt);
  Gate gate(&checkpoint::set_copy_hook_for_testing);
  rig.recovery.begin_snapshot(3, {});
  EXPECT_EQ(gate.held(), 3);
  EXPECT_EQ(rig.recovery.snapshot_in_flight(), 3);
  std::thread opener([&gate] { gate.open(); });
  rig.recovery.restore_snapshot(3);  // waits for the copy (else: no snapshot of step 3)
  opener.join();
  EXPECT_EQ(rig.recovery.snapshot_in_flight(), 0);
  for (std::int64_t b = 3; b < 5; ++b) train_step(model, opt, b);
  rig.recovery.restore_snapshot(3);
  for (std::size_t i = 0; i < params_at_3.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(model->parameters()[i], params_at_3[i])) << i;
  }
  const auto adam = adamw_state(opt);
  ASSERT_EQ(adam.size(), adam_at_3.size());
  for (std::size_t i = 0; i < adam.size(); ++i) EXPECT_TRUE(bitwise_equal(adam[i], adam_at_3[i]));
}

TEST(Recovery, ARestoreThatDoesNotFitIsRefusedAndChangesNothing) {
  auto model = make_model(7);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  Rig rig(opt, 1);
  rig.recovery.take_snapshot(1, {});
  train_step(model, opt, 1);
  const auto trained = clone_all(model->parameters());
  auto other = torch::zeros({3}, torch::requires_grad());
  opt.add_param_group(torch::optim::OptimizerParamGroup({other}));
  rig.port.refresh();
  try {
    rig.recovery.restore_snapshot(1);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("the RAM snapshot of step 1"), std::string::npos) << e.msg();
  }
  for (std::size_t i = 0; i < trained.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(model->parameters()[i], trained[i])) << i;
  }
  EXPECT_EQ(rig.recovery.snapshots_held(), 1u);
}

// A user's own optimizer: heavy-ball momentum with its own state type, saved through LibTorch's
// serialize helpers as LibTorch's optimizers do.
struct HeavyBallState : torch::optim::OptimizerCloneableParamState<HeavyBallState> {
  TORCH_ARG(torch::Tensor, velocity);

 public:
  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(velocity);
  }
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, velocity);
  }
};

class HeavyBall : public torch::optim::Optimizer {
 public:
  HeavyBall(const std::vector<torch::Tensor>& params, double lr)
      : Optimizer({torch::optim::OptimizerParamGroup(params)},
                  std::make_unique<torch::optim::SGDOptions>(lr)) {}
  torch::Tensor step(LossClosure /*closure*/ = nullptr) override {
    torch::NoGradGuard no_grad;
    for (auto& group : param_groups()) {
      const double lr = static_cast<torch::optim::SGDOptions&>(group.options()).lr();
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& slot = state_[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto fresh = std::make_unique<HeavyBallState>();
          fresh->velocity(torch::zeros_like(p));
          slot = std::move(fresh);
        }
        auto& v = static_cast<HeavyBallState&>(*slot).velocity();
        v.mul_(0.9).add_(p.grad());
        p.add_(v, -lr);
      }
    }
    return {};
  }
  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<HeavyBallState, torch::optim::SGDOptions>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<HeavyBallState, torch::optim::SGDOptions>(archive, *this);
  }
};

TEST(Recovery, OptimizersWithoutATypedCopyGoThroughTheirArchive) {
  restore_reproduces_the_next_20_steps<HeavyBall>(0.05);
  auto model = make_model(8);
  HeavyBall opt(model->parameters(), 0.05);
  train_step(model, opt, 0);
  LibTorchPort port(opt, torch::OrderedDict<std::string, torch::Tensor>());
  EXPECT_EQ(port.state_bytes().front(), 'A');  // the whole archive
  EXPECT_TRUE(port.state_tensors().empty());
}

TEST(GuardRollback, TrackedBuffersComeBackWithTheParameters) {
  auto model = make_model(14);
  auto counter = torch::zeros({2});
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(
      opt, GuardOptions().policy_yaml("version: 1\ncheckpoint: {snapshot_every: 2}\nrules:\n"
                                      "  - {on: nonfinite, action: rollback}\n"));
  torch::OrderedDict<std::string, torch::Tensor> buffers;
  buffers.insert("counter", counter);
  guard.track_buffers(buffers);
  for (std::int64_t step = 1; step <= 4; ++step) {
    counter.add_(1.0);  // like running statistics updated in the forward pass
    opt.zero_grad();
    auto loss = loss_of(model, step);
    if (step == 4) loss = loss * std::numeric_limits<double>::quiet_NaN();
    loss.backward();
    const StepReport r = guard.step(loss);
    if (step == 4) EXPECT_EQ(r.rolled_back_to, 2);
  }
  EXPECT_TRUE(torch::equal(counter, torch::full({2}, 2.0f)));  // the value after step 2
}

// The guard under a policy that snapshots every 2 steps and rolls back after 2 bad steps.
TEST(GuardRollback, BrokenWeightsAreRolledBackToTheNewestConfirmedSnapshot) {
  auto model = make_model(9);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(
      opt, model->named_parameters(),
      GuardOptions().policy_yaml("version: 1\ncheckpoint: {snapshot_every: 2, snapshot_keep: 2}\n"
                                 "rules:\n  - {on: nonfinite, consecutive: 2, action: rollback, "
                                 "skip_batches: 7}\n"));
  std::vector<torch::Tensor> at_4;
  std::vector<torch::Tensor> adam_at_4;
  for (std::int64_t step = 1; step <= 5; ++step) {
    opt.zero_grad();
    auto loss = loss_of(model, step);
    loss.backward();
    ASSERT_TRUE(guard.step(loss).applied());
    if (step == 4) {
      at_4 = clone_all(model->parameters());
      adam_at_4 = adamw_state(opt);
    }
  }
  // Step 5 confirmed the snapshot of step 4. Now a weight breaks.
  {
    torch::NoGradGuard no_grad;
    model->parameters()[0].view(-1)[0].fill_(std::numeric_limits<float>::quiet_NaN());
  }
  std::vector<StepReport> reports;
  for (std::int64_t step = 6; step <= 7; ++step) {
    opt.zero_grad();
    auto loss = loss_of(model, step);
    loss.backward();
    reports.push_back(guard.step(loss));
  }
  EXPECT_EQ(reports[0].outcome, Outcome::kSkipped);
  EXPECT_EQ(reports[1].outcome, Outcome::kRolledBack);
  EXPECT_EQ(reports[1].rolled_back_to, 4);
  EXPECT_EQ(reports[1].batches_to_skip, 7);
  EXPECT_EQ(reports[1].actions, std::vector<Action>({Action::kRollback}));
  ASSERT_TRUE(reports[1].incident.has_value());
  EXPECT_STREQ(to_string(reports[1].incident->action), "rollback");
  EXPECT_NE(reports[1].incident->reason.find("(rolled back to step 4)"), std::string::npos);
  for (std::size_t i = 0; i < at_4.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(model->parameters()[i], at_4[i])) << i;
    EXPECT_FALSE(model->parameters()[i].grad().defined() &&
                 model->parameters()[i].grad().abs().sum().item<double>() != 0.0);
  }
  const auto adam = adamw_state(opt);
  ASSERT_EQ(adam.size(), adam_at_4.size());
  for (std::size_t i = 0; i < adam.size(); ++i) EXPECT_TRUE(bitwise_equal(adam[i], adam_at_4[i]));
  EXPECT_EQ(guard.stats().totals.rolled_back, 1);
  EXPECT_EQ(guard.stats().step_count, 7);  // the step counter keeps counting
  // Training goes on from the restored state.
  opt.zero_grad();
  auto loss = loss_of(model, 8);
  loss.backward();
  EXPECT_TRUE(guard.step(loss).applied());
}

// A guard that snapshots after every step and rolls back on a non-finite step.
struct RollbackRun {
  explicit RollbackRun(std::uint64_t seed)
      : model(make_model(seed)),
        opt(model->parameters(), torch::optim::AdamWOptions(1e-2)),
        guard(opt, model->named_parameters(),
              GuardOptions().metrics_port(0).policy_yaml(
                  "version: 1\ncheckpoint: {snapshot_every: 1, snapshot_keep: 2}\nrules:\n"
                  "  - {on: nonfinite, action: rollback}\n")) {}
  // Forward and backward of `batch` (NaN loss when `bad`), as the loop runs them before step().
  torch::Tensor backward(std::int64_t batch, bool bad = false) {
    opt.zero_grad();
    auto loss = loss_of(model, batch);
    if (bad) loss = loss * std::numeric_limits<double>::quiet_NaN();
    loss.backward();
    return loss;
  }
  torch::nn::Sequential model;
  torch::optim::AdamW opt;
  GuardedOptimizer guard;
};

// The training thread is back from step() while the snapshot's copy has not even started (held
// at the gate); the loop's next forward and backward run beside it, and the next step() waits
// for the copy before it changes anything.
TEST(GuardRollback, StepReturnsBeforeItsSnapshotIsCopied) {
  RollbackRun run(18);
  Gate gate(&checkpoint::set_copy_hook_for_testing);
  ASSERT_TRUE(run.guard.step(run.backward(1)).applied());
  EXPECT_EQ(gate.held(), 1);
  EXPECT_EQ(gate.passed(), 0);        // step() returned before the copy ran
  const auto loss = run.backward(2);  // beside the copy: reads the parameters, changes none
  std::thread opener([&gate] { gate.open(); });
  ASSERT_TRUE(run.guard.step(loss).applied());  // waits for the copy of step 1 first
  opener.join();
  EXPECT_EQ(run.guard.stats().snapshots_held, 2);  // waits for step 2's copy
  EXPECT_EQ(gate.passed(), 2);                     // step 1's copy, then step 2's
  EXPECT_EQ(run.guard.stats().totals.snapshots, 2);
}

// The snapshot copied while the next step's forward and backward ran is the one a rollback
// restores, bitwise (parameters and AdamW state); the step that rolls back waits for the copy
// of the step before it.
TEST(GuardRollback, ARollbackRestoresASnapshotCopiedInTheBackgroundBitwise) {
  RollbackRun run(19);
  ASSERT_TRUE(run.guard.step(run.backward(1)).applied());
  const auto at_1 = clone_all(run.model->parameters());
  ASSERT_TRUE(run.guard.step(run.backward(2)).applied());  // confirms step 1's snapshot
  run.guard.wait_for_background_work();  // step 2's copy is done: the gate holds step 3's
  Gate gate(&checkpoint::set_copy_hook_for_testing);
  ASSERT_TRUE(run.guard.step(run.backward(3)).applied());  // confirms step 2's
  const auto at_3 = clone_all(run.model->parameters());
  const auto adam_at_3 = adamw_state(run.opt);
  EXPECT_EQ(gate.held(), 3);  // step 3's copy waits at the gate
  const auto loss = run.backward(4);
  std::thread opener([&gate] { gate.open(); });
  ASSERT_TRUE(run.guard.step(loss).applied());  // confirms step 3's, once it has landed
  opener.join();
  const StepReport r = run.guard.step(run.backward(5, /*bad=*/true));
  ASSERT_EQ(r.outcome, Outcome::kRolledBack);
  EXPECT_EQ(r.rolled_back_to, 3);
  for (std::size_t i = 0; i < at_3.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(run.model->parameters()[i], at_3[i])) << i;
    EXPECT_FALSE(bitwise_equal(at_3[i], at_1[i])) << i;  // two applied steps apart
  }
  const auto adam = adamw_state(run.opt);
  ASSERT_EQ(adam.size(), adam_at_3.size());
  for (std::size_t i = 0; i < adam.size(); ++i) EXPECT_TRUE(bitwise_equal(adam[i], adam_at_3[i]));
}

// A copy that fails in the background (out of host memory) is reported when the next step waits
// for it, the way a snapshot that cannot be taken is: logged, counted, the older snapshots stay
// and a rollback goes to one of them.
TEST(GuardRollback, ASnapshotCopyThatFailsIsReportedAndTheOlderOnesStay) {
  RollbackRun run(20);
  for (std::int64_t step = 1; step <= 2; ++step) {
    ASSERT_TRUE(run.guard.step(run.backward(step)).applied());
  }
  const auto at_2 = clone_all(run.model->parameters());
  run.guard.wait_for_background_work();  // step 2's copy is done: the gate holds step 3's
  ::testing::internal::CaptureStderr();
  {
    Gate gate(&checkpoint::set_copy_hook_for_testing);
    ASSERT_TRUE(run.guard.step(run.backward(3)).applied());
    EXPECT_EQ(gate.held(), 3);
    gate.open(/*fail=*/true);
    EXPECT_EQ(run.guard.stats().snapshots_held, 1u);  // step 2's; step 1's buffers went to the copy
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("step 3: the RAM snapshot could not be taken (std::bad_alloc); training goes "
                     "on, 1 older snapshot(s) held"),
            std::string::npos)
      << err;
  const std::string text = run.guard.metrics_text();
  EXPECT_NE(text.find("stepguard_snapshot_failures_total{"), std::string::npos);
  EXPECT_NE(text.find("} 1\n", text.find("stepguard_snapshot_failures_total{")), std::string::npos)
      << text;
  EXPECT_EQ(run.guard.stats().totals.snapshots, 2);
  const StepReport r = run.guard.step(run.backward(4, /*bad=*/true));
  ASSERT_EQ(r.outcome, Outcome::kRolledBack);
  EXPECT_EQ(r.rolled_back_to, 2);
  for (std::size_t i = 0; i < at_2.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(run.model->parameters()[i], at_2[i])) << i;
  }
}

TEST(GuardRollback, WithoutAConfirmedSnapshotTheStepIsSkipped) {
  auto model = make_model(10);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(
      opt, GuardOptions().policy_yaml("version: 1\ncheckpoint: {snapshot_every: 100}\nrules:\n"
                                      "  - {on: nonfinite, action: rollback, skip_batches: 3}\n"));
  opt.zero_grad();
  auto loss = loss_of(model, 0) * std::numeric_limits<double>::quiet_NaN();
  loss.backward();
  const StepReport r = guard.step(loss);
  EXPECT_EQ(r.outcome, Outcome::kSkipped);
  EXPECT_EQ(r.actions, std::vector<Action>({Action::kSkipBatch}));
  EXPECT_EQ(r.batches_to_skip, 3);
  EXPECT_NE(r.incident->reason.find("no confirmed snapshot to roll back to yet"), std::string::npos)
      << r.incident->reason;
}

// The one check of a saved optimizer state both ports rely on: names a restore can place, no
// quantized dtype, and the optimizer's own dtype and shape where it already holds the tensor.
TEST(OptimizerTensors, WhatNoPortCouldRestoreIsRefusedNamingTheTensor) {
  using checkpoint::NamedTensor;
  const std::vector<NamedTensor> live = {{"0.exp_avg", torch::zeros({4, 3})},
                                         {"0.step", torch::zeros({})}};
  const auto refusal = [&](const std::vector<NamedTensor>& saved) {
    try {
      checkpoint::check_optimizer_tensors(saved, live, 2, "ckpt");
    } catch (const checkpoint::CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(refusal({{"0.exp_avg", torch::ones({4, 3})}, {"1.exp_avg", torch::ones({7})}}), "");
  EXPECT_EQ(refusal({}), "");  // an optimizer before its first step
  EXPECT_EQ(refusal({{"0.exp_avg", torch::ones({3, 4})}}),
            "ckpt: optimizer state tensor '0.exp_avg' is Float[3, 4] in the checkpoint, Float"
            "[4, 3] in the optimizer");
  EXPECT_EQ(refusal({{"2.exp_avg", torch::ones({4})}}),
            "ckpt: optimizer state tensor '2.exp_avg' belongs to parameter 2; the optimizer has 2");
  EXPECT_EQ(refusal({{"exp_avg", torch::ones({4})}}),
            "ckpt: optimizer state tensor 'exp_avg' is not named <parameter index>.<key>");
  EXPECT_EQ(refusal({{"1.m", torch::ones({2})}, {"1.m", torch::ones({2})}}),
            "ckpt: optimizer state tensor '1.m' is saved twice");
  const auto quantized = at::quantize_per_tensor(torch::ones({4, 3}), 0.1, 0, at::kQInt8);
  EXPECT_EQ(refusal({{"1.exp_avg", quantized}}),
            "ckpt: optimizer state tensor '1.exp_avg' has the quantized dtype QInt8");
}

}  // namespace
}  // namespace stepguard
