// The step controller: the knobs the policy turns (loss scale, LR factor, clipping target), the
// snapshot book and the final decision (rollback or its skip fallback), and the decision state's
// round trip. Expected values are derived by hand from the documented semantics
// (configs/policies/README.md) and PyTorch GradScaler's documented update rule.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>

#include "plugin/src/step_controller.h"
#include "tests/support/policy_scenarios.h"

namespace stepguard {
namespace {

using testing_support::describe;
using testing_support::parse;
using testing_support::stats_for;

TEST(StepController, OutcomeFollowsTheStrongestAction) {
  StepController c(parse("version: 1\ncheckpoint: {snapshot_every: 1}\nrules:\n"
                         "  - {on: nonfinite_loss, action: rollback}\n"
                         "  - {on: nonfinite_grad, action: skip_batch}\n"),
                   false);
  SnapshotBook book(1, 2);
  // Snapshots every step: step 2 confirms step 1's; the bad step 3 discards step 2's.
  const char* steps = "ccnl";
  const Outcome expected[] = {Outcome::kApplied, Outcome::kApplied, Outcome::kSkipped,
                              Outcome::kRolledBack};
  for (std::int64_t s = 1; s <= 4; ++s) {
    const StepDecision d = c.decide(s, stats_for(steps[s - 1], s), &book);
    EXPECT_EQ(d.decision.outcome, expected[s - 1]) << "step " << s;
    if (book.due(s, d.decision.outcome)) book.add(s, c.encode());
    if (s == 4) EXPECT_EQ(d.rolled_back_to, 1);
  }
}

TEST(StepController, ClipTargetIsTheEmaMeanPlusZDeviations) {
  // Grad norms 2.2, 2.0, 2.2, 2.0 with decay 0.5 (alpha 0.5):
  //   mean 2.2 var 0; mean 2.1 var 0.5*(0+0.5*0.04)=0.01; mean 2.15 var 0.5*(0.01+0.5*0.01)=0.0075;
  //   mean 2.075 var 0.5*(0.0075+0.5*0.0225)=0.009375. Target = 2.075 + 3*sqrt(0.009375).
  StepController c(parse("version: 1\ndetectors:\n  grad_norm_spike: {z: 3, warmup: 4, decay: "
                         "0.5}\nrules:\n  - {on: grad_norm_spike, action: clip}\n"),
                   false);
  for (std::int64_t s = 1; s <= 4; ++s) c.decide(s, stats_for('c', s));
  const StepDecision d = c.decide(5, stats_for('G', 5));
  EXPECT_NEAR(d.decision.clip_norm, 2.075 + 3 * 0.0968245836551854, 1e-12);
  // An explicit z on the rule overrides the detector's.
  StepController z1(parse("version: 1\ndetectors:\n  grad_norm_spike: {z: 3, warmup: 4, decay: "
                          "0.5}\nrules:\n  - {on: grad_norm_spike, action: clip, z: 1}\n"),
                    false);
  for (std::int64_t s = 1; s <= 4; ++s) z1.decide(s, stats_for('c', s));
  EXPECT_NEAR(z1.decide(5, stats_for('G', 5)).decision.clip_norm, 2.075 + 0.0968245836551854,
              1e-12);
}

TEST(StepController, LowerLrFloorAndLinearRecovery) {
  StepController c(parse("version: 1\nrules:\n  - {on: nonfinite, action: lower_lr, factor: 0.5, "
                         "floor: 0.3, recover_after: 1, recover_over: 2}\n"),
                   false);
  // Lowered to 0.5, then 0.25 clamps at the floor 0.3. Recovery: one good step of waiting, then
  // 0.3 -> 0.65 -> 1.0 over two good steps; the reported factor is the one the step used.
  std::vector<double> used;
  const std::string steps = "nncccc";
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const auto s = static_cast<std::int64_t>(i + 1);
    used.push_back(c.decide(s, stats_for(steps[i], s)).lr_factor);
  }
  const std::vector<double> expected = {0.5, 0.3, 0.3, 0.3, 0.65, 1.0};
  ASSERT_EQ(used.size(), expected.size());
  for (std::size_t i = 0; i < used.size(); ++i) EXPECT_NEAR(used[i], expected[i], 1e-15) << i;
  EXPECT_EQ(c.lr_factor(), 1.0);
}

TEST(StepController, GradScalerUpdateRule) {
  // GradScaler: x backoff on a NaN/Inf step, x growth after growth_interval clean steps in a row.
  StepController c(parse("version: 1\nloss_scale: {init_scale: 8, growth_interval: 2}\n"), false);
  std::vector<double> scales;
  std::vector<std::string> actions;
  const std::string steps = "ccnccc";
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const auto s = static_cast<std::int64_t>(i + 1);
    const StepDecision d = c.decide(s, stats_for(steps[i], s));
    scales.push_back(d.loss_scale);
    actions.push_back(describe(d.decision));
  }
  EXPECT_EQ(scales, std::vector<double>({8, 16, 8, 8, 16, 16}));
  EXPECT_EQ(actions[2], "skip_batch+drop_loss_scale");
}

TEST(StepController, HysteresisDelaysTheBackoff) {
  // Megatron's hysteresis 2: the first overflow is tolerated, the second backs off.
  StepController c(parse("version: 1\nloss_scale: {init_scale: 8, hysteresis: 2}\n"), false);
  EXPECT_EQ(c.decide(1, stats_for('n', 1)).loss_scale, 8);
  const StepDecision d = c.decide(2, stats_for('n', 2));
  EXPECT_EQ(d.loss_scale, 4);
  EXPECT_EQ(describe(d.decision), "skip_batch+drop_loss_scale");
}

TEST(StepController, RuleDropComesOnTopOfTheBackoff) {
  StepController c(
      parse("version: 1\nloss_scale: {init_scale: 64}\nrules:\n"
            "  - {on: [overflow, nonfinite], action: drop_loss_scale, factor: 0.25}\n"),
      false);
  // 64 x 0.5 (backoff) x 0.25 (rule) = 8.
  EXPECT_EQ(c.decide(1, stats_for('n', 1)).loss_scale, 8);
}

TEST(StepController, LossScaleAtItsFloorEscalatesInsteadOfCrashing) {
  // init 4, floor 1: 4 -> 2 -> 1 (at the floor, 1 step) -> 1 (2 steps) -> limit of 2 fires.
  StepController c(parse("version: 1\nloss_scale: {init_scale: 4, min_scale: 1}\nlimits:\n"
                         "  loss_scale_floor: {steps: 2, action: abort}\n"),
                   false);
  std::vector<std::string> got;
  for (std::int64_t s = 1; s <= 4; ++s)
    got.push_back(describe(c.decide(s, stats_for('n', s)).decision));
  EXPECT_EQ(got, std::vector<std::string>({"skip_batch+drop_loss_scale",
                                           "skip_batch+drop_loss_scale", "skip_batch", "abort"}));
}

TEST(StepController, StateRoundTripsAndDecisionsStayIdentical) {
  const policy::PolicyConfig config = parse(
      "version: 1\nloss_scale: {init_scale: 1024, growth_interval: 3}\ndetectors:\n"
      "  loss_spike: {z: 3, warmup: 4, decay: 0.5}\nrules:\n"
      "  - {on: nonfinite, within: {steps: 10, count: 2}, action: lower_lr, "
      "recover_after: 1, recover_over: 4}\n  - {on: loss_spike, action: skip_batch}\n"
      "limits:\n  max_skips: {count: 5, within: 20, action: alert}\n");
  StepController a(config, false);
  const std::string steps = "ccncnccSccncccSc";
  for (std::size_t i = 0; i < 8; ++i) {
    a.decide(static_cast<std::int64_t>(i + 1),
             stats_for(steps[i], static_cast<std::int64_t>(i + 1)));
  }
  StepController b(config, false);
  EXPECT_NE(a.digest(8), b.digest(8));
  b.decode(a.encode());
  EXPECT_EQ(a.encode(), b.encode());
  EXPECT_EQ(a.digest(8), b.digest(8));
  EXPECT_NE(a.digest(8), a.digest(9));  // the step counter is part of the digest
  for (std::size_t i = 8; i < steps.size(); ++i) {
    const auto s = static_cast<std::int64_t>(i + 1);
    const StepDecision da = a.decide(s, stats_for(steps[i], s));
    const StepDecision db = b.decide(s, stats_for(steps[i], s));
    EXPECT_EQ(describe(da.decision), describe(db.decision)) << "step " << s;
    EXPECT_EQ(da.loss_scale, db.loss_scale);
    EXPECT_EQ(da.lr_factor, db.lr_factor);
  }
  EXPECT_EQ(a.encode(), b.encode());
}

TEST(StepController, StateAfterAnOverflowStreakRoundTrips) {
  // Found by the fuzzer: a long overflow streak under hysteresis must leave a state that decodes.
  const policy::PolicyConfig config =
      parse("version: 1\nloss_scale: {init_scale: 1024, hysteresis: 2, min_scale: 1}\n");
  StepController a(config, false);
  for (std::int64_t s = 1; s <= 30; ++s) a.decide(s, stats_for('n', s));
  EXPECT_EQ(a.loss_scale(), 1);
  StepController b(config, false);
  b.decode(a.encode());
  EXPECT_EQ(b.encode(), a.encode());
}

TEST(StepController, BadStateWordsAreRejectedAndChangeNothing) {
  StepController c(parse("version: 1\nrules:\n  - {on: nonfinite, action: skip_batch}\n"), false);
  c.decide(1, stats_for('n', 1));
  const auto before = c.encode();
  EXPECT_THROW(c.decode({1, 2, 3}), std::invalid_argument);
  auto wrong = before;
  wrong.push_back(0);
  EXPECT_THROW(c.decode(wrong), std::invalid_argument);
  auto bad_lr = before;
  bad_lr[bad_lr.size() - 6] = 0;  // LR factor bits 0 -> factor 0.0
  EXPECT_THROW(c.decode(bad_lr), std::invalid_argument);
  EXPECT_EQ(c.encode(), before);
}

// The rule state is positional: a state saved under other rules (here one rule more, or the
// same number of other rules) would land on rules it does not belong to. The rules' digest
// saved with it tells: each rule's state starts afresh, the rest of the state is kept. A state
// of the same rules keeps its rule state.
TEST(StepController, AStateOfOtherRulesRestoresWithFreshRuleState) {
  const char* skip_rule =
      "version: 1\nrules:\n"
      "  - {on: nonfinite, consecutive: 3, action: skip_batch}\n"
      "  - {on: nonfinite, within: {steps: 10, count: 2}, action: lower_lr, recover_over: 4}\n";
  StepController saved(parse(skip_rule), false);
  for (std::int64_t s = 1; s <= 2; ++s) saved.decide(s, stats_for('n', s));
  ASSERT_EQ(saved.engine_state().rules[0].streak, 2);
  ASSERT_EQ(saved.engine_state().rules[1].fired, 1);
  const auto words = saved.encode();

  StepController same(parse(skip_rule), false);
  same.decode(words);
  EXPECT_EQ(same.encode(), words);

  // Two rules again, the first on another signal: the streak of 2 would land on it.
  StepController other(parse("version: 1\nrules:\n"
                             "  - {on: loss_spike, consecutive: 3, action: skip_batch}\n"
                             "  - {on: nonfinite, within: {steps: 10, count: 2}, action: "
                             "lower_lr, recover_over: 4}\n"),
                       false);
  other.decode(words);
  for (const policy::RuleState& r : other.engine_state().rules) {
    EXPECT_EQ(r, policy::RuleState{});
  }
  EXPECT_EQ(other.loss_scale(), saved.loss_scale());
  EXPECT_EQ(other.lr_factor(), saved.lr_factor());
  EXPECT_EQ(other.engine_state().bad_steps_total, saved.engine_state().bad_steps_total);

  StepController three(parse("version: 1\nrules:\n"
                             "  - {on: nonfinite, action: skip_batch}\n"
                             "  - {on: nonfinite, action: lower_lr}\n"
                             "  - {on: loss_spike, action: skip_batch}\n"),
                       false);
  three.decode(words);
  EXPECT_EQ(three.engine_state().rules.size(), 3u);
  EXPECT_EQ(three.lr_factor(), saved.lr_factor());
}

TEST(StepController, DropLossScaleNeedsLossScaling) {
  EXPECT_THROW(StepController(parse("version: 1\nrules:\n  - {on: nonfinite, action: "
                                    "drop_loss_scale}\n"),
                              false),
               std::invalid_argument);
  EXPECT_NO_THROW(StepController(parse("version: 1\nrules:\n  - {on: nonfinite, action: "
                                       "drop_loss_scale}\n"),
                                 true));
}

TEST(StepController, AFrameworksScalerTakesThePolicysLossScaleSectionAsItsOwn) {
  // A preset's section (megatron, deepspeed-fp16) inside a framework whose scaler owns the
  // scale: no scaler of the guard's; the floor limit counts the steps at the framework's floor
  // (scales 4, 2, 1, 1 with floor 1: the second overflow at the floor fires the limit of 2;
  // clean steps at the floor, as a static scale's always are, count nothing).
  const char* yaml =
      "version: 1\nloss_scale: {init_scale: 65536, min_scale: 1}\nlimits:\n"
      "  loss_scale_floor: {steps: 2, action: abort}\n";
  StepController c(parse(yaml), false, true);
  EXPECT_FALSE(c.loss_scaling());
  EXPECT_EQ(c.loss_scale(), 1.0);
  const double scales[] = {4, 2, 1, 1};
  std::vector<std::string> got;
  for (std::int64_t s = 1; s <= 4; ++s) {
    GlobalStats g = stats_for('n', s);
    g.framework_loss_scale = scales[s - 1];
    g.framework_min_scale = 1;
    const StepDecision d = c.decide(s, g);
    EXPECT_EQ(d.loss_scale, scales[s - 1]) << "step " << s;  // the framework's
    got.push_back(describe(d.decision));
  }
  EXPECT_EQ(got, std::vector<std::string>({"skip_batch", "skip_batch", "skip_batch", "abort"}));
  StepController fixed(parse(yaml), false, true);
  for (std::int64_t s = 1; s <= 6; ++s) {  // a static scale of 8, its floor itself
    GlobalStats g = stats_for(s == 6 ? 'n' : 'c', s);
    g.framework_loss_scale = g.framework_min_scale = 8;
    EXPECT_EQ(describe(fixed.decide(s, g).decision), s == 6 ? "skip_batch" : "apply") << s;
  }
  // drop_loss_scale would drop the guard's own scale: refused, whatever the option says.
  EXPECT_THROW(StepController(parse("version: 1\nrules:\n  - {on: nonfinite, action: "
                                    "drop_loss_scale}\n"),
                              true, true),
               std::invalid_argument);
}

}  // namespace
}  // namespace stepguard

namespace stepguard {
namespace {

TEST(StepController, RollbackWithoutAConfirmedSnapshotIsASkip) {
  StepController c(parse("version: 1\ncheckpoint: {snapshot_every: 5}\nrules:\n"
                         "  - {on: nonfinite_loss, action: rollback, skip_batches: 3}\n"),
                   false);
  const StepDecision d = c.decide(1, stats_for('l', 1));
  EXPECT_EQ(d.decision.outcome, Outcome::kSkipped);
  EXPECT_EQ(describe(d.decision), "skip_batch");
  EXPECT_EQ(d.decision.batches_to_skip, 3);  // the loop still drops the batches
  EXPECT_EQ(d.rolled_back_to, 0);
  EXPECT_NE(d.decision.reason.find("no confirmed snapshot to roll back to yet"), std::string::npos);
}

// The holder a rank sees when another rank holds only the snapshot of step 1.
class AgreedOnStepOne : public SnapshotBook {
 public:
  using SnapshotBook::SnapshotBook;
  std::optional<RollbackTarget> roll_back(std::int64_t, bool replicas_diverged) override {
    offered = candidates(replicas_diverged);
    RollbackTarget target{1, at(1)->words};
    drop_newer_than(1);
    return target;
  }
  std::vector<std::int64_t> offered;
};

TEST(StepController, RollbackGoesWhereTheHolderSaysAndNewerSnapshotsAreForgotten) {
  StepController c(parse("version: 1\ncheckpoint: {snapshot_every: 1, snapshot_keep: 4}\n"
                         "rules:\n  - {on: nonfinite_loss, action: rollback}\n"),
                   false);
  AgreedOnStepOne book(1, 4);
  for (std::int64_t s = 1; s <= 3; ++s) {
    if (book.due(s, c.decide(s, stats_for('c', s), &book).decision.outcome)) {
      book.add(s, c.encode());
    }
  }
  // Confirmed: 1 and 2 (3 waits for step 4, which is bad and discards it).
  const StepDecision d = c.decide(4, stats_for('l', 4), &book);
  EXPECT_EQ(book.offered, std::vector<std::int64_t>({2, 1}));
  EXPECT_EQ(d.decision.outcome, Outcome::kRolledBack);
  EXPECT_EQ(d.rolled_back_to, 1);
  EXPECT_EQ(book.steps(), std::vector<std::int64_t>({1}));
  const StepReport r = make_report(4, stats_for('l', 4), d);
  EXPECT_EQ(r.rolled_back_to, 1);
  EXPECT_EQ(r.outcome, Outcome::kRolledBack);
}

}  // namespace
}  // namespace stepguard

namespace stepguard {
namespace {

TEST(SnapshotBook, ConfirmedOnlyByACleanNextStep) {
  SnapshotBook book(10, 3);
  EXPECT_TRUE(book.due(10, Outcome::kApplied));
  EXPECT_FALSE(book.due(10, Outcome::kSkipped));
  EXPECT_FALSE(book.due(11, Outcome::kApplied));
  book.add(10, {1, 2});
  EXPECT_TRUE(book.candidates(false).empty());  // pending
  book.on_step(11, true);
  EXPECT_EQ(book.candidates(false), std::vector<std::int64_t>({10}));
  EXPECT_EQ(book.at(10)->words, std::vector<std::int64_t>({1, 2}));
  book.add(20, {3});
  book.on_step(21, false);  // the step after it raised a signal: the snapshot is the suspect
  EXPECT_EQ(book.steps(), std::vector<std::int64_t>({10}));
  // Only the snapshot of the previous step is pending; older confirmations are final.
  book.on_step(30, false);
  EXPECT_EQ(book.candidates(false), std::vector<std::int64_t>({10}));
}

TEST(SnapshotBook, AfterReplicasDivergedOnlySnapshotsFromBeforeTheLastGoodCheckAreCandidates) {
  SnapshotBook book(1, 4);
  for (std::int64_t s = 1; s <= 3; ++s) {
    book.add(s, {s});
    book.on_step(s + 1, true);
  }
  book.replicas_agreed_before(3);  // the check at step 3 passed; step 3's snapshot came after
  EXPECT_EQ(book.candidates(false), std::vector<std::int64_t>({3, 2, 1}));
  EXPECT_EQ(book.candidates(true), std::vector<std::int64_t>({2, 1}));
  const std::optional<RollbackTarget> t = book.roll_back(5, true);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->step, 2);
  EXPECT_EQ(t->words, std::vector<std::int64_t>({2}));
  EXPECT_EQ(book.steps(), std::vector<std::int64_t>({1, 2}));
}

}  // namespace
}  // namespace stepguard
