// The built-in ladder: apply when clean, skip on non-finite, abort when the streak hits its limit.
#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <limits>

#include "csrc/policy/policy.h"

namespace stepguard {
namespace policy {
namespace {

GlobalStats clean() {
  GlobalStats g;
  g.sum_squares = 4.0;
  g.grad_norm = 2.0;
  g.loss = 1.5;
  return g;
}
GlobalStats nan_grads() {
  GlobalStats g = clean();
  g.nan_count = 3;
  g.faulty_ranks = {0};
  return g;
}
GlobalStats bad_loss() {
  GlobalStats g = clean();
  g.loss_nonfinite_ranks = 1;
  g.loss = std::numeric_limits<double>::quiet_NaN();
  return g;
}

TEST(Policy, CleanStepIsApplied) {
  PolicyEngine engine;
  const Signals s = engine.detect(clean());
  EXPECT_FALSE(s.any());
  const Decision d = engine.decide(s);
  EXPECT_EQ(d.outcome, Outcome::kApplied);
  EXPECT_EQ(d.actions, std::vector<Action>({Action::kApply}));
  EXPECT_TRUE(d.reason.empty());
}

TEST(Policy, NonFiniteGradientsOrLossAreSkipped) {
  PolicyEngine engine;
  Signals s = engine.detect(nan_grads());
  EXPECT_EQ(s.raised, std::vector<Signal>({Signal::kNonfiniteGrad}));
  Decision d = engine.decide(s);
  EXPECT_EQ(d.outcome, Outcome::kSkipped);
  EXPECT_EQ(d.actions, std::vector<Action>({Action::kSkipBatch}));
  EXPECT_EQ(d.reason, "nonfinite_grad");

  GlobalStats both = nan_grads();
  both.loss_nonfinite_ranks = 1;
  s = engine.detect(both);
  EXPECT_EQ(s.raised, std::vector<Signal>({Signal::kNonfiniteLoss, Signal::kNonfiniteGrad}));
  EXPECT_EQ(engine.decide(s).reason, "nonfinite_loss, nonfinite_grad");
  EXPECT_EQ(engine.state().consecutive_bad_steps, 2);
}

TEST(Policy, StreakLimitAborts) {
  PolicyEngine engine(PolicyConfig{3});
  EXPECT_EQ(engine.decide(engine.detect(bad_loss())).outcome, Outcome::kSkipped);
  EXPECT_EQ(engine.decide(engine.detect(bad_loss())).outcome, Outcome::kSkipped);
  const Signals s = engine.detect(bad_loss());
  EXPECT_TRUE(s.has(Signal::kConsecutiveLimit));
  EXPECT_EQ(s.consecutive_bad_steps, 3);
  const Decision d = engine.decide(s);
  EXPECT_EQ(d.outcome, Outcome::kAborted);
  EXPECT_EQ(d.reason, "nonfinite_loss, consecutive_limit (3 bad steps in a row, limit 3)");
}

TEST(Policy, ZeroLimitNeverAborts) {
  PolicyEngine engine;
  for (int i = 0; i < 1000; ++i) {
    ASSERT_EQ(engine.decide(engine.detect(nan_grads())).outcome, Outcome::kSkipped);
  }
  EXPECT_EQ(engine.state().bad_steps_total, 1000);
}

TEST(Policy, CleanStepResetsTheStreakButNotTheTotal) {
  PolicyEngine engine(PolicyConfig{2});
  engine.detect(nan_grads());
  engine.detect(clean());
  EXPECT_EQ(engine.state().consecutive_bad_steps, 0);
  EXPECT_EQ(engine.state().bad_steps_total, 1);
  EXPECT_EQ(engine.decide(engine.detect(nan_grads())).outcome, Outcome::kSkipped);
}

TEST(Policy, DecisionIsAPureFunctionOfStatsAndRestoredState) {
  PolicyEngine a(PolicyConfig{5});
  for (int i = 0; i < 4; ++i) a.detect(nan_grads());
  PolicyEngine b(PolicyConfig{5});
  b.restore(a.state());
  EXPECT_EQ(a.state(), b.state());
  const Decision da = a.decide(a.detect(nan_grads()));
  const Decision db = b.decide(b.detect(nan_grads()));
  EXPECT_EQ(da.outcome, Outcome::kAborted);
  EXPECT_EQ(da.outcome, db.outcome);
  EXPECT_EQ(da.reason, db.reason);
}

TEST(Policy, NegativeLimitIsRejected) {
  EXPECT_THROW({ PolicyEngine engine(PolicyConfig{-1}); }, c10::Error);
}

}  // namespace
}  // namespace policy
}  // namespace stepguard
