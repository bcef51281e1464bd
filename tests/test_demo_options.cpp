// The demo's command line: every bad flag gets one line naming it.
#include <gtest/gtest.h>

#include "plugin/cli/demo/demo_options.h"

namespace stepguard {
namespace demo {
namespace {

std::string parse_error(const std::vector<std::string>& args) {
  std::string error;
  bool help = false;
  EXPECT_FALSE(parse_demo_args(args, &error, &help).has_value());
  EXPECT_FALSE(help);
  return error;
}

TEST(DemoOptions, Defaults) {
  std::string error;
  bool help = false;
  const auto o = parse_demo_args({}, &error, &help);
  ASSERT_TRUE(o.has_value()) << error;
  EXPECT_EQ(o->steps, 300);
  EXPECT_EQ(o->ranks, 1);
  EXPECT_TRUE(o->injections.empty());
}

TEST(DemoOptions, ParsesTheContractFlags) {
  std::string error;
  bool help = false;
  const auto o =
      parse_demo_args({"--steps", "120", "--seed=9", "--inject", "nan_grad@50", "--inject",
                       "inf_grad@70:0", "--summary-json", "s.json", "--trace", "t.jsonl"},
                      &error, &help);
  ASSERT_TRUE(o.has_value()) << error;
  EXPECT_EQ(o->steps, 120);
  EXPECT_EQ(o->seed, 9u);
  ASSERT_EQ(o->injections.size(), 2u);
  EXPECT_EQ(o->injections[0].kind, FaultKind::kNanGrad);
  EXPECT_EQ(o->injections[0].step, 50);
  EXPECT_EQ(o->injections[0].rank, -1);
  EXPECT_EQ(o->injections[1].kind, FaultKind::kInfGrad);
  EXPECT_EQ(o->injections[1].rank, 0);
  EXPECT_EQ(o->summary_json, "s.json");
  EXPECT_EQ(o->trace, "t.jsonl");
}

TEST(DemoOptions, AllFaultKindsParse) {
  for (const char* kind : {"nan_grad", "inf_grad", "nan_loss", "nan_input", "overflow", "lr_spike",
                           "loss_spike", "corrupt_weights", "kill"}) {
    std::string error;
    const auto inj = parse_injection(std::string(kind) + "@3", &error);
    ASSERT_TRUE(inj.has_value()) << kind << ": " << error;
    EXPECT_STREQ(to_string(inj->kind), kind);
  }
}

TEST(DemoOptions, BadInjectionsNameTheValue) {
  std::string error;
  EXPECT_FALSE(parse_injection("nan_grad", &error));
  EXPECT_EQ(error.rfind("--inject 'nan_grad': expected KIND@STEP[:RANK]", 0), 0u) << error;
  EXPECT_FALSE(parse_injection("nan_gard@5", &error));
  EXPECT_EQ(error.rfind("--inject 'nan_gard@5': unknown fault kind 'nan_gard'", 0), 0u) << error;
  EXPECT_FALSE(parse_injection("nan_grad@0", &error));
  EXPECT_EQ(error, "--inject 'nan_grad@0': step '0' is not a whole number >= 1");
  EXPECT_FALSE(parse_injection("nan_grad@5x", &error));
  EXPECT_EQ(error, "--inject 'nan_grad@5x': step '5x' is not a whole number >= 1");
  EXPECT_FALSE(parse_injection("nan_grad@5:", &error));
  EXPECT_EQ(error, "--inject 'nan_grad@5:': rank '' is not a whole number >= 0");
}

TEST(DemoOptions, BadFlagsNameTheFlag) {
  EXPECT_EQ(parse_error({"--steps", "0"}), "--steps '0': expected a whole number >= 1");
  EXPECT_EQ(parse_error({"--steps"}), "--steps: missing value");
  EXPECT_EQ(parse_error({"--lr", "nan"}), "--lr 'nan': expected a number in (0, 1]");
  EXPECT_EQ(parse_error({"--bogus"}), "unknown flag '--bogus' (see stepguard demo --help)");
  EXPECT_EQ(parse_error({"--ranks", "0"}), "--ranks '0': expected a whole number in [1, 64]");
  EXPECT_EQ(parse_error({"--collective-timeout", "0"}),
            "--collective-timeout '0': expected whole seconds in [1, 86400]");
  EXPECT_EQ(
      parse_error({"--inject", "overflow@5"}).rfind("--inject overflow: needs --precision fp16", 0),
      0u);
  EXPECT_EQ(parse_error({"--precision", "fp8"}), "--precision 'fp8': expected fp32 or fp16");
}

TEST(DemoOptions, HelpIsNotAnError) {
  std::string text;
  bool help = false;
  EXPECT_FALSE(parse_demo_args({"--help"}, &text, &help).has_value());
  EXPECT_TRUE(help);
  EXPECT_NE(text.find("usage: stepguard demo"), std::string::npos);
}

}  // namespace
}  // namespace demo
}  // namespace stepguard
