// The wrapper: an applied step equals a plain optimizer step bitwise, a skipped step changes
// nothing, bad input is refused with a clear error and changes nothing.
#include <gtest/gtest.h>
#include <stepguard/stepguard.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/support/guard_archive.h"
#include "tests/support/model_fixture.h"

namespace stepguard {
namespace {

TEST(GuardedOptimizer, AppliedStepsEqualPlainOptimizerStepsBitwise) {
  auto guarded_model = make_model(1);
  auto plain_model = make_model(1);
  torch::optim::AdamW guarded_opt(guarded_model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW plain_opt(plain_model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(guarded_opt);
  for (int step = 0; step < 5; ++step) {
    guarded_opt.zero_grad();
    auto loss = loss_of(guarded_model, step);
    loss.backward();
    const StepReport r = guard.step(loss);
    EXPECT_EQ(r.outcome, Outcome::kApplied);
    EXPECT_EQ(r.step, step + 1);
    EXPECT_EQ(r.actions, std::vector<Action>({Action::kApply}));
    EXPECT_FALSE(r.incident.has_value());
    EXPECT_EQ(r.loss, loss.item<double>());

    plain_opt.zero_grad();
    auto plain_loss = loss_of(plain_model, step);
    plain_loss.backward();
    double sq = 0;
    for (const auto& p : plain_model->parameters()) {
      sq += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
    }
    EXPECT_NEAR(r.grad_norm, std::sqrt(sq), 1e-12 * std::sqrt(sq));
    plain_opt.step();
  }
  const auto a = guarded_model->parameters();
  const auto b = plain_model->parameters();
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << i;
  EXPECT_EQ(guard.stats().totals.applied, 5);
  EXPECT_EQ(guard.stats().collective_calls, 5);  // one collective per step
}

TEST(GuardedOptimizer, SkippedStepLeavesParametersAndOptimizerStateBitwiseUnchanged) {
  auto model = make_model(2);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(opt, model->named_parameters());
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    auto loss = loss_of(model, step);
    loss.backward();
    ASSERT_TRUE(guard.step(loss).applied());
  }
  const auto params_before = clone_all(model->parameters());
  const auto state_before = adamw_state(opt);
  ASSERT_EQ(state_before.size(), 3 * params_before.size());

  opt.zero_grad();
  auto loss = loss_of(model, 3);
  loss.backward();
  auto& g = model->named_parameters()["2.weight"].mutable_grad();
  g.view(-1)[5] = std::numeric_limits<float>::quiet_NaN();
  const StepReport r = guard.step(loss);

  EXPECT_EQ(r.outcome, Outcome::kSkipped);
  EXPECT_EQ(r.actions, std::vector<Action>({Action::kSkipBatch}));
  EXPECT_EQ(r.nonfinite_count, 1);
  ASSERT_TRUE(r.incident.has_value());
  EXPECT_STREQ(to_string(r.incident->signal), "nonfinite_grad");
  EXPECT_STREQ(to_string(r.incident->action), "skip_batch");
  EXPECT_EQ(r.incident->tensors, std::vector<std::string>({"2.weight"}));
  EXPECT_EQ(r.incident->ranks, std::vector<int>({0}));
  const auto params_after = model->parameters();
  for (std::size_t i = 0; i < params_after.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(params_before[i], params_after[i])) << i;
  }
  const auto state_after = adamw_state(opt);
  ASSERT_EQ(state_after.size(), state_before.size());
  for (std::size_t i = 0; i < state_after.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(state_before[i], state_after[i])) << i;
  }
  for (const auto& p : model->parameters()) {
    EXPECT_TRUE(torch::all(p.grad() == 0).item<bool>());  // zeroed on skip
  }
  EXPECT_EQ(guard.stats().totals.skipped, 1);
}

TEST(GuardedOptimizer, NonFiniteLossIsSkipped) {
  auto model = make_model(3);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(opt);
  opt.zero_grad();
  auto loss = loss_of(model, 0);
  loss.backward();
  const auto before = clone_all(model->parameters());
  const StepReport r = guard.step(torch::tensor(std::numeric_limits<float>::infinity()));
  EXPECT_EQ(r.outcome, Outcome::kSkipped);
  ASSERT_TRUE(r.incident.has_value());
  EXPECT_STREQ(to_string(r.incident->signal), "nonfinite_loss");
  EXPECT_TRUE(std::isinf(r.loss));  // every rank's loss is +Inf: Inf, not NaN
  EXPECT_NE(r.incident->evidence.front().find("the loss is Inf"), std::string::npos)
      << r.incident->evidence.front();
  const auto after = model->parameters();
  for (std::size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(bitwise_equal(before[i], after[i]));
}

TEST(GuardedOptimizer, GradlessParameterIsAllowed) {
  auto used = torch::randn({3}, torch::requires_grad());
  auto unused = torch::randn({2}, torch::requires_grad());
  torch::optim::SGD opt({used, unused}, torch::optim::SGDOptions(0.5));
  GuardedOptimizer guard(opt);
  auto loss = (used * used).sum();
  loss.backward();
  ASSERT_FALSE(unused.grad().defined());
  const auto before = used.detach().clone();
  const StepReport r = guard.step(loss);
  EXPECT_TRUE(r.applied());
  // SGD: p -= 0.5 * 2p = 0.
  EXPECT_TRUE(torch::allclose(used.detach(), before - 0.5 * 2 * before));
}

TEST(GuardedOptimizer, StepWithoutALossDecidesOnTheGradientsAndSaysSo) {
  auto a = make_model(4);
  auto b = make_model(4);
  torch::optim::SGD plain(a->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt(b->parameters(), torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(opt);
  loss_of(a, 0).backward();
  plain.step();
  loss_of(b, 0).backward();
  const StepReport r = guard.step();
  EXPECT_TRUE(r.applied());
  EXPECT_FALSE(r.loss_given);
  EXPECT_TRUE(std::isnan(r.loss));
  EXPECT_GT(r.grad_norm, 0.0);
  const auto pa = a->parameters();
  const auto pb = b->parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(bitwise_equal(pa[i], pb[i]));
  // A NaN gradient is still caught without a loss.
  opt.zero_grad();
  loss_of(b, 1).backward();
  pb[0].mutable_grad().view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
  const auto before = clone_all(pb);
  const StepReport bad = guard.step();
  EXPECT_EQ(bad.outcome, Outcome::kSkipped);
  for (std::size_t i = 0; i < pb.size(); ++i) EXPECT_TRUE(bitwise_equal(before[i], pb[i]));
}

void expect_error_containing(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    FAIL() << "expected an error containing: " << needle;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(GuardedOptimizer, BadLossIsRefusedAndChangesNothing) {
  auto model = make_model(4);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(opt);
  auto loss = loss_of(model, 0);
  loss.backward();
  const auto before = clone_all(model->parameters());
  expect_error_containing(
      [&] {
        guard.step(torch::ones({2, 3}));
      },
      "loss must be a scalar (one element), got shape [2, 3]");
  expect_error_containing([&] { guard.step(torch::tensor(3, torch::kLong)); },
                          "loss must be a floating-point tensor, got Long");
  expect_error_containing([&] { guard.step(torch::empty({}, torch::device(torch::kMeta))); },
                          "loss is on meta but the gradients are on cpu");
  expect_error_containing([&] { guard.step(torch::ones({1}).to_sparse()); },
                          "loss must be a dense tensor, got Sparse");
  EXPECT_EQ(guard.stats().step_count, 0);
  EXPECT_EQ(guard.stats().collective_calls, 0);
  const auto after = model->parameters();
  for (std::size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(bitwise_equal(before[i], after[i]));
}

TEST(GuardedOptimizer, UnsupportedGradientDtypeIsRefused) {
  auto p = torch::zeros({4}, torch::kFloat).requires_grad_();
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(opt);
  p.mutable_grad() = torch::ones({4}, torch::kFloat).to(torch::kComplexFloat);
  expect_error_containing([&] { guard.step(torch::tensor(1.0)); },
                          "gradient 0 has dtype ComplexFloat");
  EXPECT_EQ(guard.stats().step_count, 0);
}

TEST(GuardedOptimizer, AbortsAfterTheConsecutiveBadStepLimitAndRefusesFurtherSteps) {
  auto model = make_model(5);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(opt, GuardOptions().max_consecutive_bad_steps(3));
  const auto nan_loss = torch::tensor(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(guard.step(nan_loss).outcome, Outcome::kSkipped);
  EXPECT_EQ(guard.step(nan_loss).outcome, Outcome::kSkipped);
  const StepReport r = guard.step(nan_loss);
  EXPECT_EQ(r.outcome, Outcome::kAborted);
  EXPECT_EQ(r.actions, std::vector<Action>({Action::kAbort}));
  ASSERT_TRUE(r.incident.has_value());
  EXPECT_STREQ(to_string(r.incident->action), "abort");
  EXPECT_TRUE(guard.stats().aborted);
  expect_error_containing([&] { guard.step(torch::tensor(1.0)); },
                          "training was aborted at step 3");
}

TEST(GuardedOptimizer, GoodStepResetsTheBadStreak) {
  auto model = make_model(6);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.0));
  GuardedOptimizer guard(opt, GuardOptions().max_consecutive_bad_steps(2));
  const auto nan_loss = torch::tensor(std::numeric_limits<float>::quiet_NaN());
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(guard.step(nan_loss).outcome, Outcome::kSkipped);
    EXPECT_EQ(guard.step(torch::tensor(1.0)).outcome, Outcome::kApplied);
  }
  EXPECT_FALSE(guard.stats().aborted);
}

TEST(GuardedOptimizer, LossScalingUnscalesInThePassAndMatchesAPlainStepBitwise) {
  auto scaled_model = make_model(11);
  auto plain_model = make_model(11);
  torch::optim::AdamW scaled_opt(scaled_model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW plain_opt(plain_model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(scaled_opt, GuardOptions().loss_scaling(true));
  EXPECT_EQ(guard.stats().loss_scale, 65536.0);
  for (int step = 0; step < 3; ++step) {
    scaled_opt.zero_grad();
    auto loss = loss_of(scaled_model, step);
    guard.scale_loss(loss).backward();
    const StepReport r = guard.step(loss);
    EXPECT_TRUE(r.applied());
    EXPECT_EQ(r.loss_scale, 65536.0);
    EXPECT_EQ(r.loss, loss.item<double>());  // the report speaks of the unscaled loss
    plain_opt.zero_grad();
    loss_of(plain_model, step).backward();
    plain_opt.step();
  }
  // Scaling by a power of two and unscaling by its inverse is exact.
  const auto a = scaled_model->parameters();
  const auto b = plain_model->parameters();
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << i;
}

TEST(GuardedOptimizer, OverflowSkipsAndHalvesTheLossScale) {
  auto model = make_model(12);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(opt, GuardOptions().loss_scaling(true));
  opt.zero_grad();
  auto loss = loss_of(model, 0);
  guard.scale_loss(loss).backward();
  model->named_parameters()["0.weight"].mutable_grad()[0][0] = INFINITY;  // fp16 overflow
  const auto before = clone_all(model->parameters());
  const StepReport r = guard.step(loss);
  EXPECT_EQ(r.outcome, Outcome::kSkipped);
  EXPECT_EQ(r.actions, std::vector<Action>({Action::kSkipBatch, Action::kDropLossScale}));
  EXPECT_EQ(r.loss_scale, 32768.0);
  EXPECT_EQ(guard.stats().loss_scale, 32768.0);
  const auto after = model->parameters();
  for (std::size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(bitwise_equal(before[i], after[i]));
}

TEST(GuardedOptimizer, PolicyFileLossScaleSectionSetsTheNumbers) {
  const std::string path = ::testing::TempDir() + "/sg_loss_scale_policy.yaml";
  std::ofstream(path) << "version: 1\nloss_scale:\n  init_scale: 8\n  growth_interval: 2\n";
  auto p = torch::zeros({2}, torch::requires_grad());
  torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(sgd, GuardOptions().policy(path));
  EXPECT_EQ(guard.stats().loss_scale, 8.0);
  const std::string initial = testing_support::saved_bytes(guard);
  for (int i = 0; i < 2; ++i) {
    sgd.zero_grad();
    auto loss = (p - 1.0).pow(2).sum();
    guard.scale_loss(loss).backward();
    guard.step(loss);
  }
  EXPECT_EQ(guard.stats().loss_scale, 16.0);  // grown after 2 clean steps
  // A loaded archive brings the scale back with it.
  testing_support::load_bytes(guard, initial);
  EXPECT_EQ(guard.stats().loss_scale, 8.0);
  EXPECT_EQ(guard.stats().step_count, 0);
  const std::string broken =
      testing_support::edited_bytes(guard, [](std::vector<std::int64_t>& w) { w.pop_back(); });
  try {
    testing_support::load_bytes(guard, broken);
    ADD_FAILURE() << "a decision state one word short loaded";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("does not fit this guard"), std::string::npos) << e.msg();
  }
  EXPECT_EQ(guard.stats().loss_scale, 8.0);  // nothing changed
  std::remove(path.c_str());
}

TEST(GuardedOptimizer, PolicyFileSetsTheLimit) {
  const std::string path = ::testing::TempDir() + "/sg_guard_policy.yaml";
  std::ofstream(path) << "version: 1\nlimits:\n  max_consecutive_bad_steps: 2\n";
  auto model = make_model(9);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(opt, GuardOptions().policy(path));
  const auto nan_loss = torch::tensor(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(guard.step(nan_loss).outcome, Outcome::kSkipped);
  EXPECT_EQ(guard.step(nan_loss).outcome, Outcome::kAborted);

  expect_error_containing(
      [&] { GuardedOptimizer both(opt, GuardOptions().policy(path).max_consecutive_bad_steps(4)); },
      "max_consecutive_bad_steps is set both in GuardOptions and through the policy");
  std::ofstream(path) << "version: 1\nlimits: {max_bad: 1}\n";
  try {
    GuardedOptimizer bad(opt, GuardOptions().policy(path));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(e.msg(), path +
                           ":2:10: unknown key 'max_bad' in 'limits' (known: "
                           "max_consecutive_bad_steps, max_skips, max_rollbacks, "
                           "loss_scale_floor)");
  }
  std::remove(path.c_str());
}

TEST(GuardedOptimizer, WritesOneTraceLinePerStep) {
  const std::string path = ::testing::TempDir() + "/stepguard_trace_test.jsonl";
  {
    auto model = make_model(7);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    GuardedOptimizer guard(opt, model->named_parameters(), GuardOptions().trace_path(path));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      auto loss = loss_of(model, step);
      loss.backward();
      if (step == 1) model->named_parameters()["0.bias"].mutable_grad()[0] = INFINITY;
      guard.step(loss);
    }
  }
  std::ifstream in(path);
  std::string line;
  std::vector<nlohmann::json> lines;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 3u);
  for (const char* key : {"step", "loss", "grad_norm", "nonfinite", "loss_scale", "lr_factor",
                          "outcome", "actions"}) {
    EXPECT_TRUE(lines[0].contains(key)) << key;
  }
  EXPECT_EQ(lines[0]["outcome"], "applied");
  EXPECT_EQ(lines[1]["outcome"], "skipped");
  EXPECT_EQ(lines[1]["step"], 2);
  EXPECT_EQ(lines[1]["inf"], 1);
  EXPECT_EQ(lines[1]["actions"], nlohmann::json::array({"skip_batch"}));
  EXPECT_EQ(lines[1]["tensors"], nlohmann::json::array({"0.bias"}));
  std::remove(path.c_str());
}

TEST(GuardedOptimizer, UnwritableTracePathIsAClearError) {
  auto model = make_model(8);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  try {
    // A missing folder is made (as incident_dir's); one under a file cannot be.
    GuardedOptimizer guard(opt, GuardOptions().trace_path("/dev/null/trace.jsonl"));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("cannot open event log '/dev/null/trace.jsonl'"), std::string::npos)
        << e.msg();
  }
}

// Each stage is timed every step, the RAM snapshot apart from act, and the stages add up to no more
// than the step itself.
TEST(GuardedOptimizer, LastStageSecondsSplitsEachStepWithTheSnapshotApart) {
  auto model = make_model(3);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(opt, model->named_parameters(),
                         GuardOptions().policy_yaml(
                             "version: 1\ncheckpoint: {snapshot_every: 2, snapshot_keep: 1}\n"));
  EXPECT_EQ(guard.stats().last_step_seconds.total(), 0.0);
  std::vector<StageSeconds> seen;
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    auto loss = loss_of(model, step);
    loss.backward();
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(guard.step(loss).applied());
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const StageSeconds& s = guard.stats().last_step_seconds;
    for (double stage : {s.inspect, s.agree, s.decide, s.act, s.record}) EXPECT_GT(stage, 0.0);
    EXPECT_GE(s.snapshot, 0.0);
    EXPECT_LE(s.total(), wall);
    seen.push_back(s);
  }
  EXPECT_EQ(guard.stats().totals.snapshots, 1);  // step 2's copy: more than step 1's cadence check
  EXPECT_GT(seen[1].snapshot, seen[0].snapshot);
}

TEST(GuardedOptimizer, APresetIsAcceptedByName) {
  auto model = make_model(6);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(opt, GuardOptions().policy("megatron"));
  auto loss = loss_of(model, 0);
  loss.backward();
  EXPECT_TRUE(guard.step(loss).applied());
  try {
    GuardedOptimizer typo(opt, GuardOptions().policy("megatorn"));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "stepguard: policy 'megatorn' is neither a file nor a shipped preset (did you "
                  "mean 'megatron'?) (presets: debug-strict, deepspeed-fp16, default, megatron, "
                  "palm-rollback)"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace stepguard

namespace stepguard {
namespace {

TEST(GuardedOptimizer, SaveAndLoadCarryTheGuardAndTheOptimizerTogether) {
  auto model = make_model(21);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(opt);
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    auto loss = loss_of(model, step);
    loss.backward();
    guard.step(loss);
  }
  guard.set_data_position(7);
  const std::string saved = testing_support::saved_bytes(guard);
  const GuardStats at_save = guard.stats();
  const auto moments = adamw_state(opt);

  auto fresh_model = make_model(22);
  torch::optim::AdamW fresh_opt(fresh_model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer fresh(fresh_opt);
  testing_support::load_bytes(fresh, saved);
  const GuardStats loaded = fresh.stats();
  EXPECT_EQ(loaded.step_count, 3);
  EXPECT_EQ(loaded.data_position, 7);
  EXPECT_EQ(loaded.totals.applied, at_save.totals.applied);
  const auto fresh_moments = adamw_state(fresh_opt);
  ASSERT_EQ(fresh_moments.size(), moments.size());
  for (std::size_t i = 0; i < moments.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(fresh_moments[i], moments[i])) << i;
  }

  // An archive without the guard's part is refused by name, and nothing changes.
  torch::serialize::OutputArchive optimizer_only;
  opt.save(optimizer_only);
  std::ostringstream out;
  optimizer_only.save_to(out);
  try {
    testing_support::load_bytes(fresh, out.str());
    ADD_FAILURE() << "an archive without 'stepguard' loaded";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("lacks the key 'stepguard'"), std::string::npos) << e.msg();
  }
  EXPECT_EQ(fresh.stats().step_count, 3);
}

TEST(GuardedOptimizer, RecordedLossIsUsedByTheNextStepWithoutOne) {
  auto p = torch::zeros({2}, torch::requires_grad());
  torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(sgd);
  auto loss = (p - 1.0).pow(2).sum();
  loss.backward();
  guard.record_loss(torch::full({}, std::numeric_limits<float>::quiet_NaN()));
  const StepReport first = guard.step();
  EXPECT_TRUE(first.loss_given);
  EXPECT_FALSE(first.applied());  // the recorded NaN loss is this step's loss
  sgd.zero_grad();
  (p - 1.0).pow(2).sum().backward();
  EXPECT_FALSE(guard.step().loss_given);  // used once
  EXPECT_THROW(guard.record_loss(torch::ones({2})), c10::Error);
}

}  // namespace
}  // namespace stepguard
