// The trend detectors (csrc/policy/trend.h) through the policy engine, read from policy text as a
// run reads them: a smooth rise of the loss raises loss_trend and a step change or a spike that
// comes back never does; a stall (grad norm 0, learning rate 0, a loss flat to the last bit)
// raises stall every `steps` steps; one rank's loss standing apart for several steps raises
// rank_loss_shift (the median of its window), a single bad batch does not; the states survive
// encode/decode and a rollback's restore; the reader refuses bad settings naming the field.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "csrc/policy/policy.h"
#include "csrc/policy/policy_file.h"
#include "tests/support/policy_scenarios.h"

namespace stepguard {
namespace {

using policy::PolicyEngine;
using policy::StepInput;
using testing_support::parse;

// A finite step of `world` ranks whose mean loss is `loss`, the largest rank's `top`.
GlobalStats step_stats(double loss, double grad_norm = 1.0, double top = NAN, int world = 1) {
  GlobalStats g;
  g.loss = loss;
  g.loss_max_bound = std::isnan(top) ? loss : top;
  g.grad_norm = grad_norm;
  g.sum_squares = grad_norm * grad_norm;
  g.world_size = world;
  g.loss_given_ranks = world;
  return g;
}

StepInput input(std::int64_t step, const GlobalStats& g) {
  StepInput in;
  in.step = step;
  in.stats = g;
  return in;
}

// A loss that falls like a training run's, with a deterministic wiggle of +-3%.
double falling(std::int64_t step) {
  return (1.5 + 2.0 * std::exp(-static_cast<double>(step) / 60.0)) *
         (1.0 + 0.03 * std::sin(1.7 * static_cast<double>(step)));
}

std::vector<std::int64_t> raised(PolicyEngine& e, Signal s, std::int64_t from, std::int64_t to,
                                 double (*loss)(std::int64_t)) {
  std::vector<std::int64_t> out;
  for (std::int64_t step = from; step <= to; ++step) {
    if (e.evaluate(input(step, step_stats(loss(step)))).signals.has(s)) out.push_back(step);
  }
  return out;
}

const char* kTrend = "version: 1\ndetectors: {loss_trend: {window: 20, factor: 1.3}}\n";

TEST(LossTrend, ASmoothRiseIsRaisedOnceItOutlastsAStepChange) {
  PolicyEngine e(parse(kTrend));
  EXPECT_TRUE(raised(e, Signal::kLossTrend, 1, 200, falling).empty());
  // From step 201 the loss grows 0.5% a step (a weight growing), never spiking.
  const auto rising = [](std::int64_t step) {
    return falling(step) * std::pow(1.005, static_cast<double>(step - 200));
  };
  std::vector<std::int64_t> at;
  for (std::int64_t step = 201; step <= 400; ++step) {
    const policy::Verdict v = e.evaluate(input(step, step_stats(rising(step))));
    if (!v.signals.has(Signal::kLossTrend)) continue;
    at.push_back(step);
    ASSERT_EQ(v.signals.trends.size(), 1u);
    EXPECT_NE(v.signals.trends[0].what.find("the loss has been rising for"), std::string::npos)
        << v.signals.trends[0].what;
    EXPECT_GE(v.signals.trends[0].level, 1.3 * v.signals.trends[0].reference);
  }
  ASSERT_FALSE(at.empty());
  EXPECT_GT(at[0], 240);  // more than twice the window after the rise began
  EXPECT_LT(at[0], 300);
  // Raised again only at each further 1.3x rise, not every step.
  EXPECT_LT(at.size(), 6u);
}

TEST(LossTrend, AStepChangeOrASpikeThatComesBackIsNotATrend) {
  PolicyEngine e(parse(kTrend));
  // A new data shard at step 150 doubles the loss, which then falls again as on the first.
  const auto shard = [](std::int64_t step) {
    return step < 150 ? falling(step) : 2.0 * falling(step - 150 + 20);
  };
  EXPECT_TRUE(raised(e, Signal::kLossTrend, 1, 400, shard).empty());
  // A spike of 10 steps at 5x that comes back.
  PolicyEngine f(parse(kTrend));
  const auto spike = [](std::int64_t step) {
    return falling(step) * (step >= 200 && step < 210 ? 5.0 : 1.0);
  };
  EXPECT_TRUE(raised(f, Signal::kLossTrend, 1, 400, spike).empty());
}

TEST(LossTrend, ItsStateTravelsInTheEngineStateAndARollbackRewindsIt) {
  PolicyEngine e(parse(kTrend));
  for (std::int64_t step = 1; step <= 120; ++step)
    e.evaluate(input(step, step_stats(falling(step))));
  const policy::EngineState saved = e.state();
  ASSERT_EQ(saved.trends.size(), policy::trend_kinds().size());
  EXPECT_EQ(saved.trends[0].size(), 5u + 40u);  // counts, level and the last 2 * window losses
  const std::vector<std::int64_t> words = saved.encode();
  const policy::EngineState back =
      policy::EngineState::decode(words, saved.rules.size(), saved.rules_digest);
  EXPECT_TRUE(back == saved);
  PolicyEngine f(parse(kTrend));
  f.restore(back);
  for (std::int64_t step = 121; step <= 200; ++step) {
    e.evaluate(input(step, step_stats(falling(step))));
    f.evaluate(input(step, step_stats(falling(step))));
  }
  EXPECT_TRUE(e.state() == f.state());
  e.restore_detectors(saved);  // a rollback to step 120
  EXPECT_EQ(e.state().trends, saved.trends);
  // A state of an earlier release (no trend words) restores with the detectors fresh.
  std::vector<std::int64_t> older = words;
  older.resize(older.size() - 2 /* the spreads */ - 1 - 1 - saved.trends[0].size() -
               (saved.trends.size() - 1));
  const policy::EngineState old =
      policy::EngineState::decode(older, saved.rules.size(), saved.rules_digest);
  EXPECT_TRUE(old.trends.empty());
  f.restore(old);
  EXPECT_TRUE(f.state().trends[0].empty() || f.state().trends[0][0] == 0.0);
  // A state another window wrote is refused, naming it, and changes nothing.
  policy::EngineState other = saved;
  other.trends[0].resize(5 + 200);
  const policy::EngineState before = e.state();
  EXPECT_THROW(e.restore(other), std::invalid_argument);
  EXPECT_TRUE(e.state() == before);
}

TEST(Stall, ZeroGradientsZeroLrOrAFlatLossRaiseItEveryStepsSteps) {
  PolicyEngine e(parse("version: 1\ndetectors: {stall: {steps: 5}}\n"));
  std::vector<std::int64_t> at;
  std::int64_t step = 0;
  for (int i = 0; i < 12; ++i) {
    ++step;
    const auto v = e.evaluate(input(step, step_stats(falling(step), /*grad_norm=*/0.0)));
    if (v.signals.has(Signal::kStall)) {
      at.push_back(step);
      EXPECT_NE(v.signals.trends[0].what.find("grad norm is exactly 0"), std::string::npos);
    }
  }
  EXPECT_EQ(at, (std::vector<std::int64_t>{5, 10}));
  // A moving step resets the streak; then a learning rate of 0 (the group's LR times the
  // guard's factor) stalls as well.
  ++step;
  e.evaluate(input(step, step_stats(falling(step))));
  at.clear();
  for (int i = 0; i < 5; ++i) {
    ++step;
    GlobalStats g = step_stats(falling(step));
    g.largest_lr = 0.0;
    const auto v = e.evaluate(input(step, g));
    if (v.signals.has(Signal::kStall)) {
      at.push_back(step);
      EXPECT_NE(v.signals.trends[0].what.find("the learning rate is 0"), std::string::npos);
    }
  }
  EXPECT_EQ(at.size(), 1u);
  // A loss the same to the last bit, step after step; a NaN step is not a stalled one.
  ++step;
  e.evaluate(input(step, step_stats(falling(step))));
  at.clear();
  for (int i = 0; i < 6; ++i) {
    ++step;
    if (e.evaluate(input(step, step_stats(2.5))).signals.has(Signal::kStall)) at.push_back(step);
  }
  EXPECT_EQ(at.size(), 1u);  // the first equal loss has nothing to equal yet
  GlobalStats nan = step_stats(2.5, 0.0);
  nan.nan_count = 1;
  ++step;
  e.evaluate(input(step, nan));
  EXPECT_EQ(e.state().trends[1][0], 0.0);  // the streak
  // With a LR the port cannot read (NaN) and moving gradients nothing is stalled.
  PolicyEngine f(parse("version: 1\ndetectors: {stall: {steps: 1}}\n"));
  EXPECT_FALSE(f.evaluate(input(1, step_stats(2.0))).signals.has(Signal::kStall));
}

// Two ranks: the mean loss and the largest rank's (the step buffer's loss_max_bound).
GlobalStats two_ranks(double a, double b) {
  return step_stats((a + b) / 2, 1.0, std::max(a, b), 2);
}

TEST(RankLossShift, OneRankApartForSeveralStepsIsRaisedAndOneBadBatchIsNot) {
  PolicyEngine e(parse("version: 1\ndetectors: {rank_loss_shift: }\n"));
  std::int64_t step = 0;
  const auto clean = [&step] {
    const double l = falling(step);
    return two_ranks(l * (1.0 + 0.02 * std::sin(3.1 * step)), l);
  };
  for (int i = 0; i < 100; ++i) {
    ++step;
    EXPECT_FALSE(e.evaluate(input(step, clean())).signals.has(Signal::kRankLossShift)) << step;
  }
  // One bad batch on rank 1: one step at 7x.
  ++step;
  EXPECT_FALSE(e.evaluate(input(step, two_ranks(falling(step), 7 * falling(step))))
                   .signals.has(Signal::kRankLossShift));
  for (int i = 0; i < 5; ++i) {
    ++step;
    e.evaluate(input(step, clean()));
  }
  // Rank 1's labels shuffled for 20 steps: its loss 2.7x the other's.
  std::vector<std::int64_t> at;
  const std::int64_t start = step + 1;
  for (int i = 0; i < 20; ++i) {
    ++step;
    const auto v = e.evaluate(input(step, two_ranks(falling(step), 2.7 * falling(step))));
    if (!v.signals.has(Signal::kRankLossShift)) continue;
    at.push_back(step);
    EXPECT_EQ(v.signals.trends[0].since, start + 2);
    EXPECT_NEAR(v.signals.loss_level, falling(step), 1e-9);  // the others' mean: names the rank
  }
  // From the third step of the shift (the median of the last 5 gaps), on every one after.
  EXPECT_EQ(at.front(), start + 2);
  EXPECT_EQ(at.size(), 18u);
  // The window still holds the shift for two clean steps; then it is over.
  for (int i = 0; i < 3; ++i) {
    ++step;
    EXPECT_EQ(e.evaluate(input(step, clean())).signals.has(Signal::kRankLossShift), i < 2) << i;
  }
  // One rank: nothing to compare.
  PolicyEngine one(parse("version: 1\ndetectors: {rank_loss_shift: {warmup: 0, steps: 3}}\n"));
  EXPECT_FALSE(one.evaluate(input(1, step_stats(9.0))).signals.has(Signal::kRankLossShift));
}

// detectors.optimizer_state: the engine's cadence from `every` (0 when off), and the signal on a
// checked step with bad state elements only, naming the ranks the rows named.
TEST(OptimizerStateCheck, RaisedOnACheckedStepWithBadElementsAtItsCadence) {
  EXPECT_EQ(policy::state_check_every(parse("version: 1\n").detectors.trends), 0);
  PolicyEngine e(parse("version: 1\ndetectors: {optimizer_state: {every: 10}}\n"));
  EXPECT_EQ(policy::state_check_every(e.config().detectors.trends), 10);
  EXPECT_NE(policy::explain_policy(e.config()).find("before the update every 10 steps"),
            std::string::npos);
  GlobalStats g = step_stats(2.0);
  g.state_bad_count = 3;  // not checked on this step: nothing
  EXPECT_FALSE(e.evaluate(input(1, g)).signals.has(Signal::kOptimizerState));
  g.state_checked = true;
  g.state_bad_ranks = {1, 3};
  const auto v = e.evaluate(input(2, g));
  ASSERT_TRUE(v.signals.has(Signal::kOptimizerState));
  EXPECT_EQ(v.signals.trends[0].what,
            "the optimizer state holds 3 NaN/Inf or negative second-moment elements on rank 1, 3, "
            "found before the update, which would have written them into the weights");
  g.state_bad_count = 0;  // checked and clean
  EXPECT_FALSE(e.evaluate(input(3, g)).signals.has(Signal::kOptimizerState));
}

TEST(TrendPolicy, RulesTurnThemOnAndTheReaderNamesBadSettings) {
  const policy::PolicyConfig c = parse(
      "version: 1\nrules:\n  - {on: stall, action: alert}\n  - {on: [loss_trend, "
      "rank_loss_shift], action: lower_lr, factor: 0.5}\n  - {on: optimizer_state, action: "
      "alert}\n");
  for (const policy::TrendSettings& t : c.detectors.trends) EXPECT_TRUE(t.enabled);
  EXPECT_EQ(c.rules[0].on, policy::bit(Signal::kStall));
  const std::string explained = policy::explain_policy(c);
  EXPECT_NE(explained.find("loss_trend: the loss's mean over the last 50 steps"), std::string::npos)
      << explained;
  EXPECT_NE(explained.find("stall: 20 steps in a row"), std::string::npos) << explained;
  EXPECT_NE(explained.find("training that stopped moving"), std::string::npos) << explained;
  policy::PolicyConfig out;
  const auto issues = policy::parse_policy(
      "version: 1\ndetectors:\n  loss_trend: {window: 3, factr: 2}\n  stall: {steps: 0.5}\n",
      "t.yaml", &out);
  std::string all;
  for (const auto& i : issues) all += i.format() + "\n";
  EXPECT_NE(all.find("t.yaml:3:"), std::string::npos) << all;
  EXPECT_NE(all.find("window"), std::string::npos) << all;
  EXPECT_NE(all.find("did you mean 'factor'"), std::string::npos) << all;
  EXPECT_NE(all.find("steps"), std::string::npos) << all;
  const auto off = policy::parse_policy(
      "version: 1\ndetectors: {stall: {enabled: false}}\nrules:\n  - {on: stall, action: alert}\n",
      "t.yaml", &out);
  ASSERT_EQ(off.size(), 1u);
  EXPECT_NE(off[0].format().find("can never fire: 'detectors.stall' is disabled"),
            std::string::npos)
      << off[0].format();
}

}  // namespace
}  // namespace stepguard
