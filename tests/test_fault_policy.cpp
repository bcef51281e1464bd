// The default preset against the faults of the practitioners' list, at the decision level (the
// step controller with a snapshot book, as a live run and `stepguard replay` decide): an fp16
// overflow streak is the scaler's business, a loss spike is caught from the third step on, and a
// divergence the first LR cut does not fix keeps escalating until it is contained or the run
// aborts. The numbers follow configs/policies/default.yaml; the live runs are in
// tests/python/test_fault_matrix.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "csrc/policy/presets.h"
#include "plugin/src/step_controller.h"
#include "tests/support/policy_scenarios.h"

namespace stepguard {
namespace {

using testing_support::describe;
using testing_support::parse;

std::string preset(const char* name) {
  const std::string* text = policy::find_policy_preset(name);
  if (text == nullptr) throw std::invalid_argument(std::string("no preset ") + name);
  return *text;
}

// A finite step: loss and grad norm as given.
GlobalStats finite(double loss, double grad_norm = 1.0) {
  GlobalStats g;
  g.loss = loss;
  g.loss_max_bound = loss;
  g.grad_norm = grad_norm;
  g.sum_squares = grad_norm * grad_norm;
  return g;
}

// What fp16 overflow looks like: thousands of Inf with a few NaN where Inf met Inf, finite loss.
GlobalStats overflow() {
  GlobalStats g = finite(2.5);
  g.inf_count = 24194;
  g.nan_count = 44;
  g.faulty_ranks = {0};
  return g;
}

bool has(const StepDecision& d, Signal s) { return d.signals.has(s); }

TEST(DefaultPreset, AnOverflowStreakOnlySkipsAndBacksTheScaleOff) {
  StepController c(parse(preset("default")), /*loss_scaling=*/true);
  SnapshotBook book(50, 2);
  for (std::int64_t step = 1; step <= 5; ++step) {
    const StepDecision d = c.decide(step, overflow(), &book);
    EXPECT_TRUE(has(d, Signal::kOverflow)) << step;
    EXPECT_FALSE(has(d, Signal::kNonfiniteGrad)) << step;
    EXPECT_EQ(describe(d.decision), "skip_batch+drop_loss_scale") << step;
    EXPECT_EQ(d.lr_factor, 1.0) << step;
    EXPECT_EQ(d.loss_scale, 65536.0 / std::pow(2.0, static_cast<double>(step))) << step;
  }
  EXPECT_EQ(describe(c.decide(6, finite(2.4), &book).decision), "apply");
  EXPECT_EQ(c.lr_factor(), 1.0);
}

TEST(DefaultPreset, AnOverflowStreakAtTheFloorEscalates) {
  StepController c(parse(preset("default") + "loss_scale: {init_scale: 4, min_scale: 1}\n"), true);
  SnapshotBook book(50, 2);
  EXPECT_TRUE(has(c.decide(1, overflow(), &book), Signal::kOverflow));  // 4 -> 2
  EXPECT_TRUE(has(c.decide(2, overflow(), &book), Signal::kOverflow));  // 2 -> 1, the floor
  // At the floor the scale cannot fix it: the non-finite ladder applies (3 in a row: LR cut).
  for (std::int64_t step = 3; step <= 4; ++step) {
    const StepDecision d = c.decide(step, overflow(), &book);
    EXPECT_TRUE(has(d, Signal::kNonfiniteGrad)) << step;
    EXPECT_EQ(describe(d.decision), "skip_batch") << step;
  }
  EXPECT_EQ(describe(c.decide(5, overflow(), &book).decision), "skip_batch+lower_lr");
  EXPECT_EQ(c.lr_factor(), 0.5);
}

TEST(DefaultPreset, AnOverflowAnFp32ReplayReproducedIsNotOneNorANonFiniteLoss) {
  StepController c(parse(preset("default")), true);
  GlobalStats reproduced = overflow();
  reproduced.overflow_ruled_out = true;
  EXPECT_TRUE(has(c.decide(1, reproduced, nullptr), Signal::kNonfiniteGrad));
  // NaN alone (overflowed gradients averaged over ranks: Inf + -Inf) is an overflow too, as
  // GradScaler and DeepSpeed take it, until a replay or the floor says otherwise.
  GlobalStats nan_only = finite(2.5);
  nan_only.nan_count = 7;
  EXPECT_TRUE(has(c.decide(2, nan_only, nullptr), Signal::kOverflow));
  nan_only.overflow_ruled_out = true;
  EXPECT_TRUE(has(c.decide(3, nan_only, nullptr), Signal::kNonfiniteGrad));
  GlobalStats bad_loss = overflow();
  bad_loss.loss = std::nan("");
  bad_loss.loss_nonfinite_ranks = 1;
  const StepDecision d = c.decide(4, bad_loss, nullptr);
  EXPECT_TRUE(has(d, Signal::kNonfiniteLoss));
  EXPECT_TRUE(has(d, Signal::kNonfiniteGrad));
  EXPECT_EQ(describe(d.decision), "skip_batch+drop_loss_scale");  // the 2nd in a row of the ladder
}

TEST(DefaultPreset, WithoutLossScalingInfIsANonfiniteGradient) {
  StepController c(parse(preset("default")), false);
  EXPECT_TRUE(has(c.decide(1, overflow(), nullptr), Signal::kNonfiniteGrad));
}

// The loss of a run's first steps: falling fast from ~ln(vocabulary), a little noise.
double early_loss(std::int64_t step) {
  return 1.5 + 9.0 * std::exp(-0.08 * static_cast<double>(step)) +
         0.05 * std::sin(1.7 * static_cast<double>(step));
}

TEST(DefaultPreset, ALossSpikeIsCaughtFromTheThirdStep) {
  for (const std::int64_t spike_at : {3, 20, 300}) {
    StepController c(parse(preset("default")), false);
    SnapshotBook book(50, 2);
    for (std::int64_t step = 1; step < spike_at; ++step) {
      const StepDecision d = c.decide(step, finite(early_loss(step)), &book);
      ASSERT_FALSE(d.signals.any()) << "false alarm at step " << step;
      if (book.due(step, d.decision.outcome)) book.add(step, c.encode());
    }
    const StepDecision d = c.decide(spike_at, finite(10.0 * early_loss(spike_at - 1)), &book);
    EXPECT_TRUE(has(d, Signal::kLossSpike)) << spike_at;
    EXPECT_TRUE(d.decision.has(Action::kLowerLr)) << spike_at;
    // Before the first confirmed snapshot the rollback is a skip; the loop still drops 20.
    EXPECT_EQ(d.decision.outcome, spike_at > 50 ? Outcome::kRolledBack : Outcome::kSkipped);
    EXPECT_EQ(d.decision.batches_to_skip, 20) << spike_at;
  }
}

TEST(DefaultPreset, OneRanksSpikeIsCaughtAtAnyWorldSize) {
  StepController c(parse(preset("default")), false);
  for (std::int64_t step = 1; step < 20; ++step) {
    ASSERT_FALSE(c.decide(step, finite(early_loss(step))).signals.any()) << step;
  }
  // 64 ranks, one at 10x: the mean moves 14%; the bound of the largest rank loss is that rank's.
  const double typical = early_loss(19);
  GlobalStats g = finite(typical * (63.0 + 10.0) / 64.0);
  const double mean = g.loss;
  const double variance =
      (63.0 * typical * typical + 100.0 * typical * typical) / 64.0 - mean * mean;
  g.loss_max_bound = mean + std::sqrt(variance * 63.0);
  EXPECT_NEAR(g.loss_max_bound, 10.0 * typical, 1e-9);
  EXPECT_TRUE(has(c.decide(20, g), Signal::kLossSpike));
}

TEST(DefaultPreset, NoFalseAlarmOverTheFirstStepsOfAFallingNoisyLoss) {
  StepController c(parse(preset("default")), false);
  SnapshotBook book(50, 2);
  for (std::int64_t step = 1; step <= 400; ++step) {
    const double loss = early_loss(step) * (1.0 + 0.08 * std::sin(0.9 * static_cast<double>(step)));
    const double norm = 3.0 * std::exp(-0.01 * static_cast<double>(step)) + 0.5;
    const StepDecision d = c.decide(step, finite(loss, norm), &book);
    ASSERT_FALSE(d.signals.any()) << "step " << step << ": " << d.decision.reason;
    if (book.due(step, d.decision.outcome)) book.add(step, c.encode());
  }
}

// A learning-rate bug from step 151 (the schedule multiplies it by 100): the loss jumps from 0.36
// to ~3 and, after each rollback, climbs back within a few steps. Every spike rolls back and cuts
// the LR again; when the rollback budget is spent the run aborts, the loss still up.
struct GuardRun {
  explicit GuardRun(const std::string& policy = preset("default"))
      : controller(parse(policy), false) {}
  StepController controller;
  SnapshotBook book{50, 2};
  std::vector<StepDecision> decisions;
  StepDecision step(std::int64_t s, const GlobalStats& g) {
    StepDecision d = controller.decide(s, g, &book);
    if (book.due(s, d.decision.outcome)) book.add(s, controller.encode());
    decisions.push_back(d);
    return d;
  }
};

double settled_loss(std::int64_t step) {
  return 0.36 + 0.01 * std::sin(1.3 * static_cast<double>(step));
}

// Feeds steps from `s` on: the loss climbs from 0.36 to 3.06 over `ramp` steps after each restore.
// Returns the step that aborted (0: none by `last`).
std::int64_t diverge(GuardRun* run, std::int64_t s, std::int64_t last, double ramp) {
  std::int64_t since_restore = 0;
  for (; s <= last; ++s) {
    ++since_restore;
    const double rise = std::min(1.0, static_cast<double>(since_restore) / ramp);
    const StepDecision d = run->step(s, finite(0.36 + 2.7 * rise, 1.0 + 9.0 * rise));
    if (d.decision.outcome == Outcome::kRolledBack) {
      since_restore = 0;
      // Step 151's signal discarded the snapshot of step 150 (its update is the suspect), and
      // snapshots taken while the recovery is watched are not trusted.
      EXPECT_EQ(d.rolled_back_to, 100) << s;
    }
    if (d.decision.outcome == Outcome::kAborted) return s;
  }
  return 0;
}

int count(const GuardRun& run, Outcome outcome) {
  int n = 0;
  for (const StepDecision& d : run.decisions) n += d.decision.outcome == outcome ? 1 : 0;
  return n;
}

bool fired(const StepDecision& d, const char* rule) {
  return std::find(d.decision.rules.begin(), d.decision.rules.end(), rule) !=
         d.decision.rules.end();
}

TEST(DefaultPreset, ADivergenceThatComesBackAfterEveryRollbackIsCutAgainThenAborted) {
  GuardRun run;
  for (std::int64_t s = 1; s <= 150; ++s) {
    ASSERT_FALSE(run.step(s, finite(settled_loss(s))).signals.any()) << s;
  }
  const std::int64_t aborted_at = diverge(&run, 151, 400, 3.0);
  ASSERT_GT(aborted_at, 0);
  EXPECT_EQ(count(run, Outcome::kRolledBack), 5);
  EXPECT_TRUE(fired(run.decisions.back(), "limits.max_rollbacks"));
  EXPECT_TRUE(run.decisions.back().signals.has(Signal::kLossSpike));
  EXPECT_EQ(run.decisions.back().signals.diverging_since, 151);
  // Each spike cut the LR again: 0.5^5, held at the floor 0.05.
  EXPECT_EQ(run.controller.lr_factor(), 0.05);
}

// A divergence that creeps up after the rollback, too slowly for a spike detector: the recovery
// watch (loss_recovery) raises loss_not_recovered every 30 steps, each with a rollback and a cut.
const char* kCreepingPolicy = R"(version: 1
checkpoint: {snapshot_every: 50, snapshot_keep: 2}
detectors:
  loss_spike: {z: 1000, warmup: 100, early_factor: 0, recent_factor: 5}
  loss_recovery: {within: 30, factor: 2}
rules:
  - {name: rollback-loss-spike, on: loss_spike, action: rollback, skip_batches: 20}
  - {name: contain-divergence, on: loss_not_recovered, action: rollback}
  - {name: lower-lr-divergence, on: loss_not_recovered, action: lower_lr, factor: 0.5, floor: 0.01,
     recover_after: 100, recover_over: 500}
limits:
  max_rollbacks: {count: 5, within: 1000, action: abort}
)";

TEST(RecoveryWatch, ADivergenceTheSpikeDetectorsNoLongerSeeIsRaisedUntilTheBudgetIsSpent) {
  GuardRun run(kCreepingPolicy);
  for (std::int64_t s = 1; s <= 150; ++s) run.step(s, finite(settled_loss(s)));
  // 151: from 0.36 to 3.06 at once (a spike); after the rollback it creeps back up over 12 steps
  // (each step under 5x the largest rise before it).
  ASSERT_TRUE(run.step(151, finite(3.06, 10.0)).signals.has(Signal::kLossSpike));
  const std::int64_t aborted_at = diverge(&run, 152, 600, 12.0);
  EXPECT_EQ(aborted_at, 151 + 5 * 30);
  int raised = 0;
  for (const StepDecision& d : run.decisions) {
    if (!d.signals.has(Signal::kLossNotRecovered)) continue;
    ++raised;
    EXPECT_EQ(d.signals.diverging_since, 151);
    EXPECT_EQ(d.signals.escalations, raised);
    EXPECT_NEAR(d.signals.loss_level, 0.36, 0.011);
    EXPECT_NE(d.decision.reason.find("after the spike at step 151"), std::string::npos);
  }
  EXPECT_EQ(raised, 5);
  EXPECT_EQ(count(run, Outcome::kRolledBack), 5);  // the spike's and four raises'; the fifth aborts
  EXPECT_EQ(run.controller.lr_factor(), 0.0625);  // cut at each of the four raises that rolled back
  EXPECT_TRUE(fired(run.decisions.back(), "limits.max_rollbacks"));
}

TEST(DefaultPreset, ADivergenceTheFirstRollbackFixesEndsTheWatch) {
  GuardRun run;
  std::int64_t s = 1;
  for (; s <= 150; ++s) run.step(s, finite(settled_loss(s)));
  const StepDecision spike = run.step(151, finite(3.1, 9.0));
  ASSERT_TRUE(has(spike, Signal::kLossSpike));
  ASSERT_EQ(spike.decision.outcome, Outcome::kRolledBack);
  EXPECT_TRUE(run.controller.engine_state().watch.started == 151);
  for (s = 152; s <= 240; ++s) {
    const StepDecision d = run.step(s, finite(settled_loss(s)));
    ASSERT_FALSE(d.signals.any()) << s << ": " << d.decision.reason;
  }
  EXPECT_EQ(run.controller.engine_state().watch.started, 0);
  EXPECT_EQ(run.book.steps().back(), 200);  // snapshots are trusted again
  EXPECT_TRUE(run.book.at(200)->confirmed);
}

TEST(DefaultPreset, TheWatchSurvivesTheStateRoundTrip) {
  GuardRun run;
  for (std::int64_t s = 1; s <= 60; ++s) run.step(s, finite(settled_loss(s)));
  ASSERT_TRUE(run.step(61, finite(4.0, 9.0)).signals.has(Signal::kLossSpike));
  for (std::int64_t s = 62; s <= 70; ++s) ASSERT_FALSE(run.step(s, finite(0.5)).signals.any());
  const std::vector<std::int64_t> words = run.controller.encode();
  StepController other(parse(preset("default")), false);
  other.decode(words);
  EXPECT_EQ(other.engine_state(), run.controller.engine_state());
  EXPECT_EQ(other.engine_state().watch.started, 61);
  EXPECT_FALSE(other.engine_state().loss_ema.recent.empty());
  // A state of an earlier release (no recent windows, no watch, no trend detectors) still
  // decodes, with them empty.
  policy::EngineState older = run.controller.engine_state();
  std::vector<std::int64_t> engine_words = older.encode();
  std::size_t trend_words = 1;  // the trend detectors' count, then each one's length and state
  for (const std::vector<double>& t : older.trends) trend_words += 1 + t.size();
  const std::size_t tail = 2 + older.loss_ema.recent.size() + older.grad_norm_ema.recent.size() +
                           6 + 1 + trend_words + 2;  // the detrended spreads
  engine_words.resize(engine_words.size() - tail);
  const auto& rules = run.controller.config().rules;
  const policy::EngineState decoded =
      policy::EngineState::decode(engine_words, rules.size(), policy::rules_digest(rules));
  EXPECT_TRUE(decoded.loss_ema.recent.empty());
  EXPECT_EQ(decoded.loss_ema.spread, 0.0);
  EXPECT_EQ(decoded.watch.started, 0);
  EXPECT_EQ(decoded.loss_ema.mean, older.loss_ema.mean);
}

TEST(PolicyFile, RecentRatioAndRecoveryAreReadAndChecked) {
  const policy::PolicyConfig c = parse(
      "version: 1\ncheckpoint: {snapshot_every: 10}\ndetectors:\n"
      "  loss_spike: {recent_factor: 4, recent_window: 16}\n"
      "  loss_recovery: {within: 12, factor: 3}\n"
      "rules:\n  - {on: loss_not_recovered, action: rollback}\n"
      "  - {on: overflow, action: skip_batch}\n");
  EXPECT_EQ(c.detectors.loss_spike.ema.recent_factor, 4.0);
  EXPECT_EQ(c.detectors.loss_spike.ema.recent_window, 16);
  EXPECT_TRUE(c.detectors.loss_recovery.enabled);
  EXPECT_EQ(c.detectors.loss_recovery.within, 12);
  EXPECT_EQ(c.detectors.loss_recovery.factor, 3.0);
  EXPECT_EQ(c.rules[0].on, policy::bit(Signal::kLossNotRecovered));
  EXPECT_EQ(c.rules[1].on, policy::bit(Signal::kOverflow));
  auto issues = [](const std::string& yaml) {
    policy::PolicyConfig out;
    std::string text;
    for (const auto& i : policy::parse_policy(yaml, "case.yaml", &out)) text += i.format() + "\n";
    return text;
  };
  EXPECT_NE(issues("version: 1\ndetectors:\n  loss_spike: {recent_factor: 1}\n")
                .find("'recent_factor' must be 0 (off) or greater than 1"),
            std::string::npos);
  EXPECT_NE(
      issues("version: 1\ndetectors:\n  loss_spike: {recent_window: 1}\n").find("recent_window"),
      std::string::npos);
  EXPECT_NE(issues("version: 1\ndetectors:\n  loss_recovery: {within: 5, step: 2}\n")
                .find("unknown key 'step'"),
            std::string::npos);
  EXPECT_NE(issues("version: 1\nrules:\n  - {on: loss_not_recovered, action: alert}\n")
                .find("can never fire"),
            std::string::npos);
}

TEST(PolicyFile, TheDetrendedZScoreIsReadCheckedExplainedAndKeptInTheState) {
  const std::string yaml =
      "version: 1\ndetectors:\n  loss_spike: {detrend: true, recent_window: 16}\n"
      "rules:\n  - {on: loss_spike, action: skip_batch}\n";
  const policy::PolicyConfig c = parse(yaml);
  EXPECT_TRUE(c.detectors.loss_spike.ema.detrend);
  EXPECT_FALSE(c.detectors.grad_norm_spike.ema.detrend);
  EXPECT_TRUE(parse(preset("default")).detectors.loss_spike.ema.detrend);
  std::string issues;
  policy::PolicyConfig out;
  for (const auto& i : policy::parse_policy("version: 1\ndetectors:\n  loss_spike: {detrend: 3}\n",
                                            "case.yaml", &out)) {
    issues += i.format() + "\n";
  }
  EXPECT_NE(issues.find("case.yaml:3:"), std::string::npos) << issues;
  EXPECT_NE(issues.find("detrend"), std::string::npos) << issues;
  EXPECT_NE(policy::explain_policy(c).find("above the median of its last 16 values (detrended"),
            std::string::npos)
      << policy::explain_policy(c);
  // The spread rides in the engine's state words and comes back.
  StepController controller(c, false);
  for (std::int64_t s = 1; s <= 12; ++s) controller.decide(s, finite(2.0 + 0.1 * (s % 3)));
  ASSERT_GT(controller.engine_state().loss_ema.spread, 0.0);
  StepController other(c, false);
  other.decode(controller.encode());
  EXPECT_EQ(other.engine_state(), controller.engine_state());
}

}  // namespace
}  // namespace stepguard
