// The policy engine and the knobs it turns, table-driven: a policy file, a sequence of steps, and
// the decisions expected on each step. Expected values are derived by hand from the documented
// semantics (configs/policies/README.md) and PyTorch GradScaler's documented update rule.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "csrc/policy/policy.h"
#include "csrc/policy/policy_file.h"
#include "plugin/src/step_controller.h"

namespace stepguard {
namespace {

// One step of a scenario, by letter:
//   c clean (loss 1.0/1.1 and grad norm 2.0/2.2 alternating by step parity)
//   n NaN gradients        l NaN loss        d a rank whose state digest differs
//   S loss spike (loss 100)   G grad-norm spike (norm 100)
GlobalStats stats_for(char kind, std::int64_t step) {
  GlobalStats g;
  g.loss = 1.0 + 0.1 * static_cast<double>(step % 2);
  g.grad_norm = 2.0 + 0.2 * static_cast<double>(step % 2);
  switch (kind) {
    case 'c':
      break;
    case 'n':
      g.nan_count = 3;
      g.faulty_ranks = {0};
      break;
    case 'l':
      g.loss = std::numeric_limits<double>::quiet_NaN();
      g.loss_nonfinite_ranks = 1;
      break;
    case 'd':
      g.desynced_ranks = {1};
      break;
    case 'S':
      g.loss = 100.0;
      break;
    case 'G':
      g.grad_norm = 100.0;
      break;
    default:
      throw std::invalid_argument(std::string("unknown step kind ") + kind);
  }
  g.sum_squares = g.grad_norm * g.grad_norm;
  return g;
}

// "skip_batch+lower_lr", "rollback(10)", "apply+clip": the decision's actions, in order.
std::string describe(const Decision& d) {
  std::string out;
  for (Action a : d.actions) {
    out += (out.empty() ? "" : "+") + std::string(to_string(a));
    if (a == Action::kRollback) out += "(" + std::to_string(d.batches_to_skip) + ")";
  }
  return out;
}

policy::PolicyConfig parse(const std::string& yaml) {
  policy::PolicyConfig config;
  const auto issues = policy::parse_policy(yaml, "case.yaml", &config);
  std::string text;
  for (const auto& i : issues) text += i.format() + "\n";
  if (!issues.empty()) throw std::invalid_argument(text);
  return config;
}

struct Case {
  const char* name;
  const char* policy;
  const char* steps;
  std::vector<const char*> expected;
};

const Case kCases[] = {
    {"built-in ladder: skip every non-finite step",
     "version: 1\n",
     "cncnl",
     {"apply", "skip_batch", "apply", "skip_batch", "skip_batch"}},
    {"consecutive fires at every multiple of the streak",
     "version: 1\nrules:\n  - {on: nonfinite, action: skip_batch}\n"
     "  - {on: nonfinite, consecutive: 3, action: lower_lr}\n",
     "nnnnnnnc",
     {"skip_batch", "skip_batch", "skip_batch+lower_lr", "skip_batch", "skip_batch",
      "skip_batch+lower_lr", "skip_batch", "apply"}},
    {"a clean step breaks the streak",
     "version: 1\nrules:\n  - {on: nonfinite, consecutive: 2, action: abort}\n",
     "ncncnn",
     {"skip_batch", "apply", "skip_batch", "apply", "skip_batch", "abort"}},
    {"within: 3 raises in a window of 5 steps",
     "version: 1\nrules:\n  - {on: nonfinite, within: {steps: 5, count: 3}, action: abort}\n",
     "ncncn",
     {"skip_batch", "apply", "skip_batch", "apply", "abort"}},
    {"within: raises spread wider than the window do not fire",
     "version: 1\nrules:\n  - {on: nonfinite, within: {steps: 5, count: 3}, action: abort}\n",
     "nccccnnc",
     {"skip_batch", "apply", "apply", "apply", "apply", "skip_batch", "skip_batch", "apply"}},
    {"after_step: quiet until the step is past it",
     "version: 1\nrules:\n  - {on: nonfinite, after_step: 3, action: abort}\n",
     "nnnn",
     {"skip_batch", "skip_batch", "skip_batch", "abort"}},
    {"cooldown: quiet for K steps after firing",
     "version: 1\nrules:\n  - {on: nonfinite, cooldown: 2, action: lower_lr}\n",
     "nnnnn",
     {"skip_batch+lower_lr", "skip_batch", "skip_batch", "skip_batch+lower_lr", "skip_batch"}},
    {"rollback subsumes skip; loss-scale drop rides along",
     "version: 1\ncheckpoint: {snapshot_every: 10}\nloss_scale: {init_scale: 64}\nrules:\n"
     "  - {on: nonfinite, action: skip_batch}\n"
     "  - {on: nonfinite, action: rollback, skip_batches: 10}\n"
     "  - {on: nonfinite, action: rollback, skip_batches: 30}\n"
     "  - {on: nonfinite, action: drop_loss_scale, factor: 0.25}\n",
     "n",
     {"drop_loss_scale+rollback(30)"}},
    {"abort wins over everything",
     "version: 1\ncheckpoint: {snapshot_every: 10}\nrules:\n"
     "  - {on: nonfinite, action: rollback}\n  - {on: nonfinite, action: lower_lr}\n"
     "  - {on: nonfinite, action: abort}\n",
     "n",
     {"abort"}},
    {"a skipped step is not clipped",
     "version: 1\ndetectors:\n  grad_norm_spike: {z: 3, warmup: 4, decay: 0.5}\nrules:\n"
     "  - {on: grad_norm_spike, action: clip}\n  - {on: grad_norm_spike, action: skip_batch}\n",
     "ccccG",
     {"apply", "apply", "apply", "apply", "skip_batch"}},
    {"grad-norm spike clipped (step applied)",
     "version: 1\ndetectors:\n  grad_norm_spike: {z: 3, warmup: 4, decay: 0.5}\nrules:\n"
     "  - {on: grad_norm_spike, action: clip}\n",
     "ccccGc",
     {"apply", "apply", "apply", "apply", "apply+clip", "apply"}},
    {"warm-up: no spike before `warmup` observations",
     "version: 1\ndetectors:\n  loss_spike: {z: 3, warmup: 4, decay: 0.5}\nrules:\n"
     "  - {on: loss_spike, action: skip_batch}\n",
     "cccS",
     {"apply", "apply", "apply", "apply"}},
    {"a signal no rule acts on is an alert",
     "version: 1\ndetectors:\n  loss_spike: {z: 3, warmup: 4, decay: 0.5}\n",
     "ccccS",
     {"apply", "apply", "apply", "apply", "apply+alert"}},
    {"Megatron's ratio check",
     "version: 1\ndetectors:\n  loss_ratio: {factor: 10, reference_steps: 2}\nrules:\n"
     "  - {on: loss_ratio, action: skip_batch}\n",
     "ccS",
     {"apply", "apply", "skip_batch"}},
    {"`spike` listens to every detector that is on",
     "version: 1\ndetectors:\n  loss_spike: {z: 3, warmup: 4, decay: 0.5}\n"
     "  grad_norm_spike: {z: 3, warmup: 4, decay: 0.5}\nrules:\n"
     "  - {on: spike, action: lower_lr}\n",
     "ccccSG",
     {"apply", "apply", "apply", "apply", "apply+lower_lr", "apply+lower_lr"}},
    {"limits.max_skips aborts a loop of futility",
     "version: 1\nlimits:\n  max_skips: {count: 2, within: 10, action: abort}\n",
     "nnn",
     {"skip_batch", "skip_batch", "abort"}},
    {"limits.max_skips spread wider than the window do not fire",
     "version: 1\nlimits:\n  max_skips: {count: 2, within: 3, action: abort}\n",
     "ncncn",
     {"skip_batch", "apply", "skip_batch", "apply", "skip_batch"}},
    {"max_skips escalates to rollback; max_rollbacks then aborts",
     "version: 1\ncheckpoint: {snapshot_every: 5}\nlimits:\n"
     "  max_skips: {count: 1, within: 10, action: rollback, skip_batches: 7}\n"
     "  max_rollbacks: {count: 1, within: 100, action: abort}\n",
     "nnnn",
     {"skip_batch", "rollback(7)", "skip_batch", "abort"}},
    {"max_consecutive_bad_steps aborts",
     "version: 1\nlimits: {max_consecutive_bad_steps: 3}\n",
     "lll",
     {"skip_batch", "skip_batch", "abort"}},
    {"diverged ranks abort at once", "version: 1\n", "cd", {"apply", "abort"}},
};

class PolicyTable : public ::testing::TestWithParam<Case> {};

TEST_P(PolicyTable, DecisionsMatchTheDocumentedSemantics) {
  const Case& c = GetParam();
  StepController controller(parse(c.policy), false);
  const std::string steps = c.steps;
  ASSERT_EQ(steps.size(), c.expected.size()) << c.name;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const auto step = static_cast<std::int64_t>(i + 1);
    const StepDecision d = controller.decide(step, stats_for(steps[i], step));
    EXPECT_EQ(describe(d.decision), c.expected[i]) << c.name << ", step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(Policy, PolicyTable, ::testing::ValuesIn(kCases));

TEST(Policy, OutcomeFollowsTheStrongestAction) {
  StepController c(parse("version: 1\ncheckpoint: {snapshot_every: 5}\nrules:\n"
                         "  - {on: nonfinite_loss, action: rollback}\n"
                         "  - {on: nonfinite_grad, action: skip_batch}\n"),
                   false);
  EXPECT_EQ(c.decide(1, stats_for('c', 1)).decision.outcome, Outcome::kApplied);
  EXPECT_EQ(c.decide(2, stats_for('n', 2)).decision.outcome, Outcome::kSkipped);
  EXPECT_EQ(c.decide(3, stats_for('l', 3)).decision.outcome, Outcome::kRolledBack);
}

TEST(Policy, ClipTargetIsTheEmaMeanPlusZDeviations) {
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

TEST(Policy, LowerLrFloorAndLinearRecovery) {
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

TEST(Policy, GradScalerUpdateRule) {
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

TEST(Policy, HysteresisDelaysTheBackoff) {
  // Megatron's hysteresis 2: the first overflow is tolerated, the second backs off.
  StepController c(parse("version: 1\nloss_scale: {init_scale: 8, hysteresis: 2}\n"), false);
  EXPECT_EQ(c.decide(1, stats_for('n', 1)).loss_scale, 8);
  const StepDecision d = c.decide(2, stats_for('n', 2));
  EXPECT_EQ(d.loss_scale, 4);
  EXPECT_EQ(describe(d.decision), "skip_batch+drop_loss_scale");
}

TEST(Policy, RuleDropComesOnTopOfTheBackoff) {
  StepController c(parse("version: 1\nloss_scale: {init_scale: 64}\nrules:\n"
                         "  - {on: nonfinite, action: drop_loss_scale, factor: 0.25}\n"),
                   false);
  // 64 x 0.5 (backoff) x 0.25 (rule) = 8.
  EXPECT_EQ(c.decide(1, stats_for('n', 1)).loss_scale, 8);
}

TEST(Policy, LossScaleAtItsFloorEscalatesInsteadOfCrashing) {
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

TEST(Policy, StateRoundTripsAndDecisionsStayIdentical) {
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

TEST(Policy, StateAfterAnOverflowStreakRoundTrips) {
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

TEST(Policy, BadStateWordsAreRejectedAndChangeNothing) {
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
  // A state from a policy with another number of rules does not fit.
  StepController two(parse("version: 1\nrules:\n  - {on: nonfinite, action: skip_batch}\n"
                           "  - {on: nonfinite, action: lower_lr}\n"),
                     false);
  EXPECT_THROW(two.decode(before), std::invalid_argument);
}

TEST(Policy, DropLossScaleNeedsLossScaling) {
  EXPECT_THROW(StepController(parse("version: 1\nrules:\n  - {on: nonfinite, action: "
                                    "drop_loss_scale}\n"),
                              false),
               std::invalid_argument);
  EXPECT_NO_THROW(StepController(parse("version: 1\nrules:\n  - {on: nonfinite, action: "
                                       "drop_loss_scale}\n"),
                                 true));
}

TEST(Policy, InconsistentConfigIsRejected) {
  policy::PolicyConfig config;
  config.limits.max_consecutive_bad_steps = -1;
  EXPECT_THROW(policy::PolicyEngine{config}, std::invalid_argument);
  policy::PolicyConfig never;
  never.rules.push_back(policy::Rule{});  // listens to nothing
  EXPECT_THROW(policy::PolicyEngine{never}, std::invalid_argument);
}

}  // namespace
}  // namespace stepguard
