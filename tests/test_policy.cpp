// The policy engine, table-driven: a policy file, a sequence of steps, and the decisions expected
// on each step (before the step controller settles a rollback against the snapshots it holds).
// Expected values are derived by hand from the documented semantics (configs/policies/README.md)
// and PyTorch GradScaler's documented update rule.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "csrc/policy/policy.h"
#include "csrc/policy/policy_file.h"
#include "tests/support/policy_scenarios.h"

namespace stepguard {
namespace {

using testing_support::describe;
using testing_support::parse;
using testing_support::stats_for;

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
    {"warm-up: no z-score spike before `warmup` observations",
     "version: 1\ndetectors:\n  loss_spike: {z: 3, warmup: 4, decay: 0.5, early_factor: 0}\n"
     "rules:\n  - {on: loss_spike, action: skip_batch}\n",
     "cccS",
     {"apply", "apply", "apply", "apply"}},
    {"warm-up: a gross rise is caught by the early ratio from the 4th observation",
     "version: 1\ndetectors:\n  loss_spike: {z: 3, warmup: 4, decay: 0.5}\nrules:\n"
     "  - {on: loss_spike, action: skip_batch}\n",
     "cccS",
     {"apply", "apply", "apply", "skip_batch"}},
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
  policy::PolicyEngine engine(parse(c.policy));
  const std::string steps = c.steps;
  ASSERT_EQ(steps.size(), c.expected.size()) << c.name;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const auto step = static_cast<std::int64_t>(i + 1);
    const policy::Verdict v = engine.evaluate({step, stats_for(steps[i], step), 0});
    EXPECT_EQ(describe(v.decision), c.expected[i]) << c.name << ", step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(Policy, PolicyTable, ::testing::ValuesIn(kCases));

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
