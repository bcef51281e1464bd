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
  EXPECT_EQ(config.max_consecutive_bad_steps, 7);
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
                {"p.yaml:5:3: unknown key 'growth_intervl' in 'loss_scale' (did you mean "
                 "'growth_interval'?)",
                 "p.yaml:4:12: 'enabled' must be true or false, got 'maybe'",
                 "p.yaml:3:19: 'backoff_factor' must be a number in (0, 1), got '1.5'"}));
  EXPECT_EQ(issues_of("version: 1\nloss_scale:\n  init_scale: 4\n  min_scale: 8\n"),
            std::vector<std::string>({"p.yaml:4:14: 'min_scale' 8 is above 'init_scale'"}));
}

TEST(PolicyFile, LimitsAreOptional) {
  PolicyConfig config;
  config.max_consecutive_bad_steps = 99;
  EXPECT_TRUE(parse_policy("version: 1\n", "p.yaml", &config).empty());
  EXPECT_EQ(config.max_consecutive_bad_steps, 0);
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
            std::vector<std::string>({"p.yaml:2:1: unknown key 'checkpoints'"}));
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
  config.max_consecutive_bad_steps = 5;
  EXPECT_FALSE(parse_policy("version: 1\nlimits:\n  max_consecutive_bad_steps: 9\n  bogus: 1\n",
                            "p.yaml", &config)
                   .empty());
  EXPECT_EQ(config.max_consecutive_bad_steps, 5);
}

TEST(PolicyFile, MissingFileIsOneIssueAndLoadThrowsWithEveryLine) {
  const auto issues = check_policy_file("/nonexistent/policy.yaml", nullptr);
  ASSERT_EQ(issues.size(), 1u);
  EXPECT_EQ(issues[0].format(),
            "/nonexistent/policy.yaml:0:0: cannot read policy file: No such file or directory");

  const auto dir_issues = check_policy_file(::testing::TempDir(), nullptr);
  ASSERT_EQ(dir_issues.size(), 1u);
  EXPECT_NE(dir_issues[0].message.find("it is a directory"), std::string::npos);

  const std::string path = ::testing::TempDir() + "/sg_bad_policy.yaml";
  std::ofstream(path) << "version: 3\nlimit: {}\n";
  try {
    load_policy_file(path);
    FAIL() << "expected PolicyFileError";
  } catch (const PolicyFileError& e) {
    EXPECT_EQ(e.issues().size(), 2u);
    EXPECT_EQ(std::string(e.what()),
              path + ":2:1: unknown key 'limit' (did you mean 'limits'?)\n" + path +
                  ":1:10: unsupported schema version 3 (this stepguard reads version 1)");
  }
  std::remove(path.c_str());
}

TEST(PolicyFile, ShippedPoliciesAreValid) {
  PolicyConfig config;
  const auto issues = check_policy_file(
      std::string(STEPGUARD_SOURCE_DIR) + "/configs/policies/default.yaml", &config);
  for (const auto& i : issues) ADD_FAILURE() << i.format();
  EXPECT_EQ(config.max_consecutive_bad_steps, 50);
}

TEST(PolicyFile, ExplainSaysTheLadderInWords) {
  PolicyConfig config;
  config.max_consecutive_bad_steps = 12;
  const std::string text = explain_policy(config);
  EXPECT_NE(text.find("the batch is skipped"), std::string::npos) << text;
  EXPECT_NE(text.find("12 bad steps in a row: training is aborted"), std::string::npos) << text;
  EXPECT_NE(explain_policy(PolicyConfig{}).find("No limit"), std::string::npos);
}

}  // namespace
}  // namespace policy
}  // namespace stepguard
