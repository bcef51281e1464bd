// The step's two phases (verdict, the loop's own update, settle) and the parallel layout as a
// LibTorch loop gives them: the phases are a plain step bitwise, out of order they are refused and
// change nothing, a layout that cannot hold is refused at construction; the parameter list is
// followed by identity.
#include <gtest/gtest.h>
#include <stepguard/stepguard.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "tests/support/model_fixture.h"

namespace stepguard {
namespace {

// The two phases with the loop's own update between them equal a plain optimizer's steps
// bitwise, and the verdict's norm is the gradients' own (both computed without the guard).
TEST(StepPhases, VerdictThenTheLoopsUpdateThenSettleIsAPlainStep) {
  auto phased_model = make_model(4);
  auto plain_model = make_model(4);
  torch::optim::AdamW phased_opt(phased_model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW plain_opt(plain_model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer phased(phased_opt);
  for (int step = 0; step < 4; ++step) {
    phased_opt.zero_grad();
    auto loss = loss_of(phased_model, step);
    loss.backward();
    const Verdict v = phased.verdict(loss);
    EXPECT_EQ(v.step, step + 1);
    ASSERT_TRUE(v.applies());
    EXPECT_EQ(v.lr_factor, 1.0);
    double sq = 0;
    for (const auto& p : phased_model->parameters()) {
      sq += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
    }
    EXPECT_NEAR(v.grad_norm, std::sqrt(sq), 1e-12 * std::sqrt(sq));
    phased_opt.step();
    const StepReport report = phased.settle(v, true);
    EXPECT_TRUE(report.applied());
    EXPECT_EQ(report.grad_norm, v.grad_norm);

    plain_opt.zero_grad();
    loss_of(plain_model, step).backward();
    plain_opt.step();
  }
  const auto x = phased_model->parameters();
  const auto y = plain_model->parameters();
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(bitwise_equal(x[i], y[i])) << i;
}

// Out of order: each misuse is refused with a message and changes nothing; an update that did
// not run is recorded as a skipped step.
TEST(StepPhases, ThePhasesOutOfOrderAreRefusedAndTheGuardStaysConsistent) {
  auto model = make_model(5);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(sgd);
  auto expect_error = [](const std::function<void()>& f, const std::string& text) {
    try {
      f();
      ADD_FAILURE() << "expected: " << text;
    } catch (const c10::Error& e) {
      EXPECT_NE(e.msg().find(text), std::string::npos) << e.msg();
    }
  };
  Verdict none;
  none.step = 1;
  expect_error([&] { guard.settle(none, true); }, "settle() without a verdict");
  sgd.zero_grad();
  auto loss = loss_of(model, 0);
  loss.backward();
  const auto before = clone_all(model->parameters());
  const Verdict v = guard.verdict(loss);
  expect_error([&] { guard.verdict(loss); },
               "verdict() while the verdict of step 1 waits for its settle()");
  expect_error([&] { guard.step(loss); }, "waits for its settle()");
  Verdict other = v;
  other.step = 7;
  expect_error([&] { guard.settle(other, true); }, "the verdict of step 7");
  // The update did not run (say it threw): a skipped step, nothing changed.
  const StepReport r = guard.settle(v, false);
  EXPECT_EQ(r.outcome, Outcome::kSkipped);
  const auto after = model->parameters();
  for (std::size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(bitwise_equal(after[i], before[i]));
  EXPECT_EQ(guard.stats().totals.skipped, 1);
  expect_error([&] { guard.settle(v, true); }, "settle() without a verdict");
  // And the guard goes on.
  sgd.zero_grad();
  loss = loss_of(model, 1);
  loss.backward();
  EXPECT_EQ(guard.step(loss).outcome, Outcome::kApplied);
  EXPECT_EQ(guard.stats().step_count, 2);
}

// A layout that cannot hold in a group of one rank is refused at construction, naming it.
TEST(StepPhases, APlacementBeyondTheGroupIsRefused) {
  auto model = make_model(6);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  std::vector<Placement> layout(model->parameters().size(), Placement::replica());
  layout[1] = Placement::replicated(2);
  try {
    GuardedOptimizer guard(sgd, model->named_parameters(), layout);
    ADD_FAILURE() << "a placement of 2 copies in a group of 1 was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("parameter 1 ('0.bias') is placed replicated(2): copies must be in "
                           "[1, 1]"),
              std::string::npos)
        << e.msg();
  }
  layout[1] = Placement::shard();
  GuardedOptimizer guard(sgd, model->named_parameters(), layout);
  sgd.zero_grad();
  auto loss = loss_of(model, 0);
  loss.backward();
  EXPECT_TRUE(guard.step(loss).applied());
}

// Tensors swapped into a param group (same count, other tensors) are the ones inspected: a NaN
// gradient on them is skipped, not applied against a stale list.
TEST(StepPhases, TensorsSwappedIntoAGroupAreTheOnesInspected) {
  auto model = make_model(3);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(opt);
  opt.zero_grad();
  auto loss = loss_of(model, 0);
  loss.backward();
  ASSERT_TRUE(guard.step(loss).applied());
  std::vector<torch::Tensor> swapped;
  for (const auto& p : opt.param_groups()[0].params()) {
    swapped.push_back(p.detach().clone().requires_grad_(true));
  }
  opt.param_groups()[0].params() = swapped;
  auto sum = swapped[0].sum();
  for (std::size_t i = 1; i < swapped.size(); ++i) sum = sum + swapped[i].sum();
  sum.backward();
  swapped[1].mutable_grad().view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
  const auto before = clone_all(swapped);
  const StepReport r = guard.step(sum);
  EXPECT_EQ(r.outcome, Outcome::kSkipped);
  EXPECT_EQ(r.nonfinite_count, 1);
  for (std::size_t i = 0; i < swapped.size(); ++i)
    EXPECT_TRUE(bitwise_equal(before[i], swapped[i]));
}

// enabled(false): the wrapped optimizer steps as without the guard, whole or in two phases, with
// no collective and nothing measured; a NaN gradient is applied as the plain optimizer applies it.
TEST(StepPhases, AGuardThatIsOffStepsAsThePlainOptimizer) {
  auto off_model = make_model(6);
  auto plain_model = make_model(6);
  torch::optim::AdamW off_opt(off_model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW plain_opt(plain_model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer off(off_opt, GuardOptions().enabled(false).policy("default"));
  const auto collectives = off.stats().collective_calls;
  for (int step = 0; step < 4; ++step) {
    off_opt.zero_grad();
    auto loss = loss_of(off_model, step);
    loss.backward();
    if (step == 3) off_model->parameters()[0].mutable_grad().view(-1)[0] = NAN;
    StepReport r;
    if (step % 2 == 0) {
      r = off.step(loss);
    } else {
      const Verdict v = off.verdict(loss);
      EXPECT_TRUE(v.applies());
      EXPECT_TRUE(std::isnan(v.grad_norm));
      off_opt.step();
      r = off.settle(v, true);
    }
    EXPECT_TRUE(r.applied());
    EXPECT_EQ(r.step, step + 1);
    EXPECT_FALSE(r.loss_given);
    EXPECT_TRUE(std::isnan(r.grad_norm));
    plain_opt.zero_grad();
    loss_of(plain_model, step).backward();
    if (step == 3) plain_model->parameters()[0].mutable_grad().view(-1)[0] = NAN;
    plain_opt.step();
  }
  const auto a = off_model->parameters();
  const auto b = plain_model->parameters();
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << i;
  EXPECT_EQ(off.stats().collective_calls, collectives);
  EXPECT_EQ(off.stats().totals.applied, 4);
  EXPECT_EQ(off.stats().totals.snapshots, 0);
}

}  // namespace
}  // namespace stepguard
