// Policy files: valid files load; every problem is reported with file, line, column and a fixed
// message text.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "csrc/policy/policy_file.h"

namespace stepguard {
namespace policy {
namespace {

std::vector<std::string> issues_of(const std::string& text) {
  PolicyConfig config;
  std::vector<std::string> lines;
  for (const auto& i : parse_policy(text, "p.yaml", &config)) lines.push_back(i.format());
  return lines;
}

TEST(PolicyFile, ValidFileLoads) {
  PolicyConfig config;
  const auto issues =
      parse_policy("version: 1\nlimits:\n  max_consecutive_bad_steps: 7\n", "p.yaml", &config);
  EXPECT_TRUE(issues.empty());
  EXPECT_EQ(config.limits.max_consecutive_bad_steps, 7);
}

TEST(PolicyFile, LossScaleSection) {
  PolicyConfig config;
  ASSERT_TRUE(parse_policy("version: 1\nloss_scale:\n  init_scale: 1024\n  growth_interval: 100\n"
                           "  hysteresis: 2\n  min_scale: 1\n",
                           "p.yaml", &config)
                  .empty());
  EXPECT_TRUE(config.has_loss_scale);
  EXPECT_TRUE(config.loss_scale.enabled);
  EXPECT_EQ(config.loss_scale.init_scale, 1024);
  EXPECT_EQ(config.loss_scale.growth_interval, 100);
  EXPECT_EQ(config.loss_scale.hysteresis, 2);
  EXPECT_EQ(config.loss_scale.min_scale, 1);
  EXPECT_EQ(config.loss_scale.backoff_factor, 0.5);  // GradScaler's default
  ASSERT_TRUE(
      parse_policy("version: 1\nloss_scale: {enabled: false}\n", "p.yaml", &config).empty());
  EXPECT_FALSE(config.loss_scale.enabled);

  EXPECT_EQ(issues_of("version: 1\nloss_scale:\n  backoff_factor: 1.5\n  enabled: maybe\n"
                      "  growth_intervl: 5\n"),
            std::vector<std::string>(
                {"p.yaml:3:19: 'backoff_factor' must be a number in (0, 1), got '1.5'",
                 "p.yaml:4:12: 'enabled' must be true or false, got 'maybe'",
                 "p.yaml:5:3: unknown key 'growth_intervl' in 'loss_scale' (did you mean "
                 "'growth_interval'?)"}));
  EXPECT_EQ(issues_of("version: 1\nloss_scale:\n  init_scale: 4\n  min_scale: 8\n"),
            std::vector<std::string>({"p.yaml:4:14: 'min_scale' 8 is above 'init_scale'"}));
}

TEST(PolicyFile, LimitsAreOptional) {
  PolicyConfig config;
  config.limits.max_consecutive_bad_steps = 99;
  EXPECT_TRUE(parse_policy("version: 1\n", "p.yaml", &config).empty());
  EXPECT_EQ(config.limits.max_consecutive_bad_steps, 0);
}

TEST(PolicyFile, DuplicateKeysAreRejectedWithBothPositions) {
  // Every level: the top, a section, a rule. The first would silently win.
  EXPECT_EQ(issues_of("version: 1\nrules:\n  - {on: nonfinite, action: skip_batch}\n"
                      "rules:\n  - {on: nonfinite, action: abort}\n"),
            std::vector<std::string>(
                {"p.yaml:4:1: duplicate key 'rules' (first given at line 2, column 1)"}));
  EXPECT_EQ(issues_of("version: 1\nlimits:\n  max_consecutive_bad_steps: 3\n"
                      "  max_consecutive_bad_steps: 9\n"),
            std::vector<std::string>({"p.yaml:4:3: duplicate key 'max_consecutive_bad_steps' in "
                                      "'limits' (first given at line 3, column 3)"}));
  EXPECT_EQ(
      issues_of("version: 1\nrules:\n  - {on: nonfinite, action: skip_batch, action: abort}\n"),
      std::vector<std::string>({"p.yaml:3:41: duplicate key 'action' in rule 'rule 1' (first "
                                "given at line 3, column 21)"}));
}

TEST(PolicyFile, ASecondYamlDocumentIsRejectedNotIgnored) {
  EXPECT_EQ(issues_of("version: 1\nlimits: {max_consecutive_bad_steps: 3}\n---\nversion: 1\n"
                      "limits: {max_consecutive_bad_steps: 9}\n"),
            std::vector<std::string>({"p.yaml:3:1: a second YAML document; a policy file holds "
                                      "one (remove the '---' before it)"}));
  // A document marker before the only document is fine.
  EXPECT_TRUE(issues_of("---\nversion: 1\n").empty());
}

TEST(PolicyFile, InvalidUtf8IsRejectedWithItsPosition) {
  EXPECT_EQ(
      issues_of("version: 1\nrules:\n  - {name: caf\xe9, on: nonfinite, action: skip_batch}\n"),
      std::vector<std::string>(
          {"p.yaml:3:15: invalid UTF-8 (byte 0xe9); a policy file is UTF-8 text"}));
  // Valid multi-byte text is fine.
  EXPECT_TRUE(
      issues_of("version: 1\nrules:\n  - {name: caf\xc3\xa9, on: nonfinite, action: skip_batch}\n")
          .empty());
}

TEST(PolicyFile, UnknownKeySuggestsTheClosest) {
  EXPECT_EQ(issues_of("version: 1\nlimits:\n  max_consecutiv_bad_steps: 3\n"),
            std::vector<std::string>({"p.yaml:3:3: unknown key 'max_consecutiv_bad_steps' in "
                                      "'limits' (did you mean 'max_consecutive_bad_steps'?)"}));
  EXPECT_EQ(issues_of("verison: 1\n"),
            std::vector<std::string>(
                {"p.yaml:1:1: unknown key 'verison' (did you mean 'version'?)",
                 "p.yaml:1:1: missing required key 'version' (this stepguard reads version 1)"}));
  EXPECT_EQ(issues_of("version: 1\ncheckpoints: {}\n"),
            std::vector<std::string>(
                {"p.yaml:2:1: unknown key 'checkpoints' (did you mean 'checkpoint'?)"}));
  EXPECT_EQ(issues_of("version: 1\npolicy: {}\n"),
            std::vector<std::string>({"p.yaml:2:1: unknown key 'policy' (known: version, "
                                      "detectors, rules, limits, loss_scale, checkpoint)"}));
}

TEST(PolicyFile, WrongTypesAndValuesNameTheKey) {
  EXPECT_EQ(issues_of("version: 1\nlimits:\n  max_consecutive_bad_steps: many\n"),
            std::vector<std::string>({"p.yaml:3:30: 'max_consecutive_bad_steps' must be a whole "
                                      "number in [0, 1000000000], got 'many'"}));
  EXPECT_EQ(issues_of("version: 1\nlimits:\n  max_consecutive_bad_steps: -2\n"),
            std::vector<std::string>({"p.yaml:3:30: 'max_consecutive_bad_steps' must be a whole "
                                      "number in [0, 1000000000], got '-2'"}));
  EXPECT_EQ(issues_of("version: 1\nlimits: [1, 2]\n"),
            std::vector<std::string>({"p.yaml:2:9: 'limits' must be a map"}));
  EXPECT_EQ(issues_of("version: 2\n"),
            std::vector<std::string>(
                {"p.yaml:1:10: unsupported schema version 2 (this stepguard reads version 1)"}));
  EXPECT_EQ(issues_of("version: [1]\n"),
            std::vector<std::string>(
                {"p.yaml:1:10: 'version' must be a whole number in [1, 1000000], got a list"}));
}

TEST(PolicyFile, SyntaxErrorsCarryTheirPosition) {
  const auto lines = issues_of("version: 1\nlimits:\n  max_consecutive_bad_steps: [1, 2\n");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].rfind("p.yaml:4:1: YAML syntax error: ", 0), 0u) << lines[0];
}

TEST(PolicyFile, EmptyOrScalarDocumentIsNotAPolicy) {
  EXPECT_EQ(issues_of(""), std::vector<std::string>({"p.yaml:1:1: a policy must be a map with at "
                                                     "least 'version: 1'"}));
  EXPECT_EQ(issues_of("42\n"), std::vector<std::string>({"p.yaml:1:1: a policy must be a map "
                                                         "with at least 'version: 1'"}));
}

TEST(PolicyFile, InvalidFileLeavesTheConfigUntouched) {
  PolicyConfig config;
  config.limits.max_consecutive_bad_steps = 5;
  EXPECT_FALSE(parse_policy("version: 1\nlimits:\n  max_consecutive_bad_steps: 9\n  bogus: 1\n",
                            "p.yaml", &config)
                   .empty());
  EXPECT_EQ(config.limits.max_consecutive_bad_steps, 5);
}

TEST(PolicyFile, MissingFileIsOneIssueAndLoadThrowsWithEveryLine) {
  const auto issues = check_policy_file("/nonexistent/policy.yaml", nullptr);
  ASSERT_EQ(issues.size(), 1u);
  EXPECT_EQ(issues[0].format(),
            "/nonexistent/policy.yaml: cannot read policy file: No such file or directory");

  const auto dir_issues = check_policy_file(::testing::TempDir(), nullptr);
  ASSERT_EQ(dir_issues.size(), 1u);
  EXPECT_NE(dir_issues[0].message.find("a directory, not a file"), std::string::npos);

  const std::string path = ::testing::TempDir() + "/sg_bad_policy.yaml";
  std::ofstream(path) << "version: 3\nlimit: {}\n";
  try {
    load_policy_file(path);
    FAIL() << "expected PolicyFileError";
  } catch (const PolicyFileError& e) {
    EXPECT_EQ(e.issues().size(), 2u);
    EXPECT_EQ(std::string(e.what()),
              path + ":1:10: unsupported schema version 3 (this stepguard reads version 1)\n" +
                  path + ":2:1: unknown key 'limit' (did you mean 'limits'?)");
  }
  std::remove(path.c_str());
}

TEST(PolicyFile, RulesDetectorsLimitsAndCadenceLoad) {
  PolicyConfig c;
  const auto issues = parse_policy(R"(version: 1
detectors:
  loss_spike: {z: 5, warmup: 50, decay: 0.95}
  loss_ratio:
checkpoint: {snapshot_every: 100, snapshot_keep: 3, disk_every: 1000, disk_keep: 2}
rules:
  - name: skip-nan
    on: nonfinite
    action: skip_batch
  - on: [loss_spike, loss_ratio]
    within: {steps: 1000, count: 3}
    after_step: 200
    cooldown: 50
    action: rollback
    skip_batches: 300
  - on: nonfinite
    consecutive: 3
    action: lower_lr
    factor: 0.25
    floor: 0.05
    recover_after: 10
    recover_over: 500
  - {on: grad_norm_spike, action: clip, z: 2.5}
limits:
  max_consecutive_bad_steps: 100
  max_skips: {count: 20, within: 200, action: rollback, skip_batches: 10}
  max_rollbacks: {count: 3, within: 5000, action: abort}
)",
                                   "p.yaml", &c);
  for (const auto& i : issues) ADD_FAILURE() << i.format();
  ASSERT_EQ(c.rules.size(), 4u);
  EXPECT_EQ(c.rules[0].name, "skip-nan");
  EXPECT_EQ(c.rules[0].on, kNonfiniteSignals);
  EXPECT_EQ(c.rules[1].name, "rule 2");
  EXPECT_EQ(c.rules[1].on, bit(Signal::kLossSpike) | bit(Signal::kLossRatio));
  EXPECT_EQ(c.rules[1].within_steps, 1000);
  EXPECT_EQ(c.rules[1].within_count, 3);
  EXPECT_EQ(c.rules[1].after_step, 200);
  EXPECT_EQ(c.rules[1].cooldown, 50);
  EXPECT_EQ(c.rules[1].action.type, Action::kRollback);
  EXPECT_EQ(c.rules[1].action.skip_batches, 300);
  EXPECT_EQ(c.rules[2].consecutive, 3);
  EXPECT_EQ(c.rules[2].action.factor, 0.25);
  EXPECT_EQ(c.rules[2].action.floor, 0.05);
  EXPECT_EQ(c.rules[2].action.recover_after, 10);
  EXPECT_EQ(c.rules[2].action.recover_over, 500);
  EXPECT_EQ(c.rules[3].action.z, 2.5);
  EXPECT_TRUE(c.detectors.loss_spike.enabled);
  EXPECT_EQ(c.detectors.loss_spike.ema.threshold, 5);
  EXPECT_EQ(c.detectors.loss_spike.ema.warmup, 50);
  EXPECT_EQ(c.detectors.loss_spike.ema.decay, 0.95);
  EXPECT_TRUE(c.detectors.loss_ratio.enabled);  // `loss_ratio:` alone: on, defaults
  EXPECT_EQ(c.detectors.loss_ratio.ratio.factor, 10);
  // Used by a rule, not configured: on with the documented defaults (z 6 after 100 steps).
  EXPECT_TRUE(c.detectors.grad_norm_spike.enabled);
  EXPECT_EQ(c.detectors.grad_norm_spike.ema.threshold, 6);
  EXPECT_EQ(c.detectors.grad_norm_spike.ema.warmup, 100);
  EXPECT_EQ(c.checkpoint.snapshot_every, 100);
  EXPECT_EQ(c.checkpoint.snapshot_keep, 3);
  EXPECT_EQ(c.checkpoint.disk_every, 1000);
  EXPECT_EQ(c.checkpoint.disk_keep, 2);
  EXPECT_EQ(c.limits.max_consecutive_bad_steps, 100);
  EXPECT_TRUE(c.limits.max_skips.enabled);
  EXPECT_EQ(c.limits.max_skips.count, 20);
  EXPECT_EQ(c.limits.max_skips.window, 200);
  EXPECT_EQ(c.limits.max_skips.action.type, Action::kRollback);
  EXPECT_EQ(c.limits.max_skips.action.skip_batches, 10);
  EXPECT_EQ(c.limits.max_rollbacks.action.type, Action::kAbort);
  EXPECT_TRUE(c.has_rules);
}

TEST(PolicyFile, RuleErrorsNameThePositionAndTheFix) {
  EXPECT_EQ(issues_of("version: 1\nrules:\n  - on: nonfinte\n    action: skip_batch\n"),
            std::vector<std::string>(
                {"p.yaml:3:9: unknown signal 'nonfinte' (did you mean 'nonfinite'?); one of "
                 "nonfinite, nonfinite_grad, nonfinite_loss, loss_spike, grad_norm_spike, "
                 "loss_ratio, replica_divergence, overflow, loss_not_recovered, loss_trend, stall, "
                 "rank_loss_shift, optimizer_state, spike"}));
  EXPECT_EQ(issues_of("version: 1\nrules:\n  - on: nonfinite\n    action: skip\n"),
            std::vector<std::string>({"p.yaml:4:13: unknown action 'skip' (did you mean "
                                      "'skip_batch'?); one of skip_batch, drop_loss_scale, "
                                      "lower_lr, clip, rollback, abort, alert, reset_moments"}));
  EXPECT_EQ(issues_of("version: 1\nrules:\n  - on: nonfinite\n    action: lower_lr\n"
                      "    factr: 0.5\n"),
            std::vector<std::string>({"p.yaml:5:5: unknown key 'factr' in rule 'rule 1' (did you "
                                      "mean 'factor'?)"}));
  EXPECT_EQ(issues_of("version: 1\nrules:\n  - on: nonfinite\n    action: skip_batch\n"
                      "    factor: 0.5\n"),
            std::vector<std::string>({"p.yaml:5:5: 'factor' is not a parameter of action "
                                      "'skip_batch' (it takes none)"}));
  EXPECT_EQ(issues_of("version: 1\nrules:\n  - {on: nonfinite, action: clip, skip_batches: 3}\n"),
            std::vector<std::string>(
                {"p.yaml:3:29: rule 'rule 1' can never take effect: a non-finite step is never "
                 "applied, so there is nothing to clip",
                 "p.yaml:3:35: 'skip_batches' is not a parameter of action 'clip' (it takes z)"}));
  EXPECT_EQ(issues_of("version: 1\nrules:\n  - {on: nonfinite}\n  - action: abort\n"),
            std::vector<std::string>(
                {"p.yaml:3:5: rule 'rule 1' needs 'action' (one of skip_batch, drop_loss_scale, "
                 "lower_lr, clip, rollback, abort, alert, reset_moments)",
                 "p.yaml:4:5: rule 'rule 2' needs 'on' (a signal such as nonfinite)"}));
  EXPECT_EQ(issues_of("version: 1\nrules:\n  - {on: rank_desync, action: abort}\n"),
            std::vector<std::string>({"p.yaml:3:10: 'rank_desync' is handled by stepguard itself "
                                      "(it aborts) and cannot be used in 'on'"}));
  EXPECT_EQ(issues_of("version: 1\nrules:\n  on: nonfinite\n"),
            std::vector<std::string>({"p.yaml:3:3: 'rules' must be a list of rules (each item "
                                      "starts with '- on:')"}));
  EXPECT_EQ(issues_of("version: 1\nrules:\n  - {on: nonfinite, action: lower_lr, factor: 2, "
                      "consecutive: 0}\n"),
            std::vector<std::string>(
                {"p.yaml:3:47: 'factor' must be a number in (0, 1), got '2'",
                 "p.yaml:3:63: 'consecutive' must be a whole number in [1, 1000000000], got '0'"}));
}

// yaml-cpp's own message for this is "bad file".
TEST(PolicyFile, DeepNestingIsNamed) {
  const auto issues =
      issues_of("version: 1\nrules: " + std::string(5000, '[') + std::string(5000, ']') + "\n");
  ASSERT_EQ(issues.size(), 1u);
  EXPECT_EQ(issues[0].rfind("p.yaml:2:", 0), 0u) << issues[0];
  EXPECT_NE(issues[0].find(": nested too deeply ("), std::string::npos) << issues[0];
}

TEST(PolicyFile, TheEarlySpikeRatioIsReadAndChecked) {
  PolicyConfig c;
  ASSERT_TRUE(parse_policy("version: 1\ndetectors:\n  loss_spike: {early_factor: 4, "
                           "early_after: 8}\n",
                           "p.yaml", &c)
                  .empty());
  EXPECT_EQ(c.detectors.loss_spike.ema.early_factor, 4);
  EXPECT_EQ(c.detectors.loss_spike.ema.early_after, 8);
  EXPECT_EQ(c.detectors.grad_norm_spike.ema.early_factor, 30);  // its default, on
  EXPECT_EQ(issues_of("version: 1\ndetectors:\n  loss_spike: {early_factor: 0.5}\n"),
            std::vector<std::string>(
                {"p.yaml:3:30: 'early_factor' must be 0 (off) or greater than 1, got '0.5'"}));
  EXPECT_EQ(issues_of("version: 1\ndetectors:\n  loss_spike: {early_after: 0}\n"),
            std::vector<std::string>({"p.yaml:3:29: 'early_after' must be a whole number in "
                                      "[1, 1000000000], got '0'"}));
}

TEST(PolicyFile, ContradictionsAreReported) {
  // A window smaller than its count.
  EXPECT_EQ(issues_of("version: 1\nrules:\n  - on: nonfinite\n    within: {steps: 3, count: 5}\n"
                      "    action: abort\n"),
            std::vector<std::string>({"p.yaml:4:31: rule 'rule 1' can never fire: 'count' 5 is "
                                      "more than the window of 3 steps"}));
  // A rule on a detector that is turned off.
  EXPECT_EQ(issues_of("version: 1\ndetectors:\n  loss_spike: {enabled: false}\nrules:\n"
                      "  - {on: loss_spike, action: skip_batch}\n"),
            std::vector<std::string>({"p.yaml:5:10: rule 'rule 1' can never fire: "
                                      "'detectors.loss_spike' is disabled"}));
  // `spike` with no detector on.
  EXPECT_EQ(issues_of("version: 1\nrules:\n  - {on: spike, action: alert}\n"),
            std::vector<std::string>({"p.yaml:3:10: rule 'rule 1' can never fire: no spike "
                                      "detector is on (configure one under 'detectors')"}));
  // Rollback without snapshots; a rollback budget with nothing rolling back; a floor limit with
  // no floor.
  EXPECT_EQ(issues_of("version: 1\nrules:\n  - {on: nonfinite, action: rollback}\n"),
            std::vector<std::string>({"p.yaml:3:29: 'rollback' needs RAM snapshots: set "
                                      "'checkpoint.snapshot_every'"}));
  EXPECT_EQ(issues_of("version: 1\nlimits:\n  max_rollbacks: {count: 1, within: 10, action: "
                      "abort}\n"),
            std::vector<std::string>({"p.yaml:3:18: 'limits.max_rollbacks' can never fire: no "
                                      "rule or limit rolls back"}));
  EXPECT_EQ(issues_of("version: 1\nlimits:\n  loss_scale_floor: {steps: 10, action: abort}\n"),
            std::vector<std::string>({"p.yaml:3:21: 'limits.loss_scale_floor' can never fire: "
                                      "set 'loss_scale.min_scale' above 0"}));
  EXPECT_EQ(issues_of("version: 1\nlimits:\n  max_skips: {count: 5, action: skip_batch}\n"),
            std::vector<std::string>(
                {"p.yaml:3:14: 'limits.max_skips' needs both 'count' and 'within' (steps)",
                 "p.yaml:3:33: action 'skip_batch' is not allowed in limits.max_skips (one of "
                 "lower_lr, rollback, abort, alert)"}));
}

TEST(PolicyFile, OddYamlNeverCrashes) {
  // Shapes a fuzzer likes: every one is an issue list, never an exception or a crash.
  for (const char* text : {"version: 1\nrules: [[]]\n", "version: 1\nrules:\n  - ~\n",
                           "version: 1\nrules: ~\n", "version: 1\ndetectors: ~\n",
                           "version: 1\n? [a]\n: 1\n", "version: 1\nrules:\n  - on: []\n",
                           "version: 1\nrules:\n  - {on: [[nonfinite]], action: [abort]}\n",
                           "&a [*a]\n", "version: 1\nlimits: {max_skips: ~}\n",
                           "version: 1\nrules:\n  - {name: [], on: spike, "
                           "action: alert}\n",
                           "\xff\xfe", "version: 1\ncheckpoint: {snapshot_every: 1e99}\n"}) {
    PolicyConfig c;
    EXPECT_NO_THROW(parse_policy(text, "p.yaml", &c)) << text;
  }
}

TEST(PolicyFile, EveryPresetIsValidAndExplains) {
  for (const char* name :
       {"default", "megatron", "deepspeed-fp16", "palm-rollback", "debug-strict"}) {
    PolicyConfig config;
    const std::string path =
        std::string(STEPGUARD_SOURCE_DIR) + "/configs/policies/" + name + ".yaml";
    const auto issues = check_policy_file(path, &config);
    for (const auto& i : issues) ADD_FAILURE() << i.format();
    EXPECT_FALSE(explain_policy(config).empty()) << name;
  }
}

TEST(PolicyFile, ExplainSaysTheLadderInWords) {
  PolicyConfig config;
  ASSERT_TRUE(parse_policy("version: 1\nrules:\n  - {on: nonfinite, action: skip_batch}\n"
                           "  - {on: nonfinite, consecutive: 3, action: lower_lr, factor: 0.5, "
                           "recover_over: 500}\nlimits: {max_consecutive_bad_steps: 12}\n",
                           "p.yaml", &config)
                  .empty());
  const std::string text = explain_policy(config);
  EXPECT_NE(text.find("1. [rule 1] on a NaN/Inf gradient or loss: skip the batch."),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("2. [rule 2] on 3 steps in a row with a NaN/Inf gradient or loss (and every "
                      "3 more): multiply the LR by 0.5 (not below 0.01x), recovering linearly over "
                      "500 good steps."),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("12 bad steps in a row: abort training."), std::string::npos) << text;
  EXPECT_NE(explain_policy(PolicyConfig{}).find("no limit on bad steps in a row"),
            std::string::npos);
}

TEST(PolicyFile, AWaitWithoutARecoveryIsRefusedNotSilentlyForever) {
  // recover_over 0 keeps the LR lowered for good, so recover_after alone would wait for nothing.
  EXPECT_EQ(issues_of("version: 1\nrules:\n  - {on: nonfinite, action: lower_lr, recover_after: "
                      "200}\n"),
            std::vector<std::string>({"p.yaml:3:54: 'recover_after' without 'recover_over' "
                                      "recovers nothing (the LR stays lowered); add "
                                      "'recover_over: N' to recover over N good steps after it"}));
  EXPECT_TRUE(issues_of("version: 1\nrules:\n  - {on: nonfinite, action: lower_lr, "
                        "recover_after: 200, recover_over: 100}\n")
                  .empty());
  EXPECT_TRUE(issues_of("version: 1\nrules:\n  - {on: nonfinite, action: lower_lr}\n").empty());
}

TEST(PolicyFile, AnUnknownKeyGetsTheSchemasWordForIt) {
  // A whole part of a known key: 'factor' under loss_spike is its early_factor.
  EXPECT_EQ(issues_of("version: 1\ndetectors:\n  loss_spike: {factor: 5}\n"),
            std::vector<std::string>({"p.yaml:3:16: unknown key 'factor' in "
                                      "'detectors.loss_spike' (did you mean 'early_factor'?)"}));
  // Nothing near: the keys known there.
  const auto issues = issues_of(
      "version: 1\nrules:\n  - {on: nonfinite, action: skip_batch, "
      "steps: 3}\n");
  ASSERT_EQ(issues.size(), 1u);
  EXPECT_NE(issues[0].find("unknown key 'steps'"), std::string::npos) << issues[0];
  EXPECT_NE(issues[0].find("(known: "), std::string::npos) << issues[0];
  EXPECT_NE(issues[0].find("consecutive"), std::string::npos) << issues[0];
}

TEST(PolicyFile, ExplainHasWordsForEveryRuleThePresetsUse) {
  PolicyConfig config;
  ASSERT_TRUE(parse_policy("version: 1\ncheckpoint: {snapshot_every: 10}\nrules:\n  - {on: "
                           "replica_divergence, action: rollback}\n",
                           "p.yaml", &config)
                  .empty());
  const std::string text = explain_policy(config);
  EXPECT_NE(text.find("on a rank whose parameters differ from the other replicas': roll back"),
            std::string::npos)
      << text;
}

}  // namespace
}  // namespace policy
}  // namespace stepguard
