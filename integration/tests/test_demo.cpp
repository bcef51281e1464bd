// End-to-end: the real `stepguard demo` binary on one rank, and the CLI's other commands (policy,
// replay); the assertions read its summary JSON and trace, as a user's script would. Several ranks:
// test_demo_multirank.cpp; the default policy, checkpoints and forensics: test_demo_recovery.cpp.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "integration/tests/demo_support.h"

namespace stepguard {
namespace demo_test {
namespace {

TEST(Demo, TwoInjectedGradientFaultsAreSkippedAndTrainingLearns) {
  const std::string summary = temp_path("s.json");
  const std::string trace = temp_path("trace.jsonl");
  const ProcessResult r = run_stepguard(
      "demo --steps 300 --inject nan_grad@50 --inject inf_grad@120 "
      "--summary-json '" +
      summary + "' --trace '" + trace + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto s = read_json(summary);
  ASSERT_NO_FATAL_FAILURE(expect_summary(s, SummaryCheck()
                                                .steps(300)
                                                .skipped(2)
                                                .applied(298)
                                                .rollbacks(0)
                                                .aborted(false)
                                                .params_finite(true)
                                                .param_hashes(1)
                                                .collectives(300)
                                                .learned()));
  ASSERT_EQ(s["incidents"].size(), 2u);
  EXPECT_EQ(s["incidents"][0]["step"], 50);
  EXPECT_EQ(s["incidents"][0]["signal"], "nonfinite_grad");
  EXPECT_EQ(s["incidents"][0]["action"], "skip_batch");
  EXPECT_EQ(s["incidents"][0]["tensors"], nlohmann::json::array({"blocks.1.qkv.weight"}));
  EXPECT_EQ(s["incidents"][1]["step"], 120);
  EXPECT_EQ(s["incidents"][1]["tensors"], nlohmann::json::array({"blocks.0.fc_in.weight"}));
  for (const auto& inc : s["incidents"]) {
    for (const char* key : {"step", "signal", "action", "cause"}) EXPECT_TRUE(inc.contains(key));
  }

  // The trace has one line per step; only the injected steps were not applied.
  std::ifstream in(trace);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    ++lines;
    EXPECT_EQ(j["step"], lines);
    const bool injected = lines == 50 || lines == 120;
    EXPECT_EQ(j["outcome"], injected ? "skipped" : "applied") << line;
  }
  EXPECT_EQ(lines, 300);
  EXPECT_NE(r.out.find("stepguard demo summary"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("step 300/300"), std::string::npos) << r.err;  // progress off a terminal
}

TEST(Demo, NanLossAndNanInputAreSkipped) {
  const std::string summary = temp_path("s.json");
  const ProcessResult r = run_stepguard(
      "demo --steps 30 --inject nan_loss@10 --inject nan_input@20 "
      "--summary-json '" +
      summary + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto s = read_json(summary);
  expect_summary(s, SummaryCheck().skipped(2).applied(28).params_finite(true));
  ASSERT_EQ(s["incidents"].size(), 2u);
  EXPECT_EQ(s["incidents"][0]["step"], 10);
  EXPECT_EQ(s["incidents"][1]["step"], 20);
}

// One torch thread: with two, this machine's CPU kernels give the demo's parameters in a
// different last bit in about 1 run in 20, with or without a fault (measured: 2 of 40 clean
// 12-step runs; 30 of 30 alike with one thread), which a bitwise comparison would read as ours.
TEST(Demo, SameSeedSameParameters) {
  const std::string a = temp_path("a.json"), b = temp_path("b.json");
  const std::string run = "demo --steps 12 --seed 5 --threads 1 --inject nan_grad@4 ";
  ASSERT_EQ(run_stepguard(run + "--summary-json '" + a + "'").status, 0);
  ASSERT_EQ(run_stepguard(run + "--summary-json '" + b + "'").status, 0);
  EXPECT_EQ(read_json(a)["param_hashes"], read_json(b)["param_hashes"]);
}

TEST(Demo, CorruptWeightsWithoutRollbackAbortsAtTheBadStepLimit) {
  const std::string summary = temp_path("s.json");
  const ProcessResult r = run_stepguard(
      "demo --steps 40 --inject corrupt_weights@5 --max-bad-steps 6 "
      "--summary-json '" +
      summary + "'");
  EXPECT_EQ(r.status, 3) << r.err;
  // Bad from step 5 on: the 6th bad step in a row aborts at step 10.
  expect_summary(read_json(summary), SummaryCheck().aborted(true).steps(10).params_finite(false));
  EXPECT_NE(r.err.find("stepguard aborted training at step 10"), std::string::npos) << r.err;
}

TEST(Demo, KillEndsTheProcessAbruptly) {
  const ProcessResult r = run_stepguard("demo --steps 20 --inject kill@3");
  EXPECT_EQ(r.status, 128 + 9) << r.err;
}

TEST(Demo, BadFlagsExitTwoWithOneClearLine) {
  ProcessResult r = run_stepguard("demo --inject nan_grad@x");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "stepguard demo: --inject 'nan_grad@x': step 'x' is not a whole number >= 1\n");
  r = run_stepguard("demo --steps");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "stepguard demo: --steps: missing value\n");
  r = run_stepguard("frobnicate");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("unknown command 'frobnicate'"), std::string::npos);
}

TEST(Demo, UnwritableOutputIsAnErrorNotACrash) {
  const ProcessResult r = run_stepguard("demo --steps 2 --trace /dev/null/t.jsonl");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("cannot open event log '/dev/null/t.jsonl'"), std::string::npos) << r.err;
  // One clear line for a person, not LibTorch's C++ backtrace.
  EXPECT_EQ(r.err.find("frame #"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("Exception raised from"), std::string::npos) << r.err;
}

TEST(Demo, MissingCorpusIsAClearError) {
  const ProcessResult r = run_stepguard("demo --steps 2 --corpus /nonexistent-corpus");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("corpus directory '/nonexistent-corpus' does not exist"), std::string::npos)
      << r.err;
}

TEST(PolicyCli, ChecksFilesAndNamesEveryProblem) {
  const std::string shipped = std::string(STEPGUARD_SOURCE_DIR) + "/configs/policies/default.yaml";
  ProcessResult r = run_stepguard("policy check '" + shipped + "'");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, shipped + ": ok\n");

  const std::string bad = temp_path("bad.yaml");
  std::ofstream(bad) << "version: 1\nlimits:\n  max_consecutive_bad_steps: lots\n  bogus: 1\n";
  r = run_stepguard("policy check '" + shipped + "' '" + bad + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, bad +
                       ":3:30: 'max_consecutive_bad_steps' must be a whole number in [0, "
                       "1000000000], got 'lots'\n" +
                       bad +
                       ":4:3: unknown key 'bogus' in 'limits' (known: "
                       "max_consecutive_bad_steps, max_skips, max_rollbacks, "
                       "loss_scale_floor)\n");

  r = run_stepguard("policy explain '" + shipped + "'");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("50 bad steps in a row: abort training."), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[skip-nonfinite] on a NaN/Inf gradient or loss: skip the batch."),
            std::string::npos)
      << r.out;

  r = run_stepguard("demo --steps 2 --policy '" + bad + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find(bad + ":4:3: unknown key 'bogus'"), std::string::npos) << r.err;

  r = run_stepguard("policy frob");
  EXPECT_EQ(r.status, 2);
}

TEST(PolicyCli, DemoHonorsThePolicyLimit) {
  const std::string policy = temp_path("p.yaml");
  std::ofstream(policy) << "version: 1\nlimits:\n  max_consecutive_bad_steps: 3\n";
  const std::string summary = temp_path("s.json");
  const ProcessResult r = run_stepguard("demo --steps 30 --inject corrupt_weights@4 --policy '" +
                                        policy + "' --summary-json '" + summary + "'");
  EXPECT_EQ(r.status, 3) << r.err;
  expect_summary(read_json(summary), SummaryCheck().steps(6));
}

TEST(PolicyCli, EveryPresetChecksAndExplains) {
  const std::string dir = std::string(STEPGUARD_SOURCE_DIR) + "/configs/policies/";
  for (const char* name :
       {"default", "megatron", "deepspeed-fp16", "palm-rollback", "debug-strict"}) {
    const std::string file = dir + name + ".yaml";
    ProcessResult r = run_stepguard("policy check '" + file + "'");
    EXPECT_EQ(r.status, 0) << name << ": " << r.err;
    r = run_stepguard("policy explain '" + file + "'");
    EXPECT_EQ(r.status, 0) << name;
    EXPECT_NE(r.out.find("Rules, checked in this order"), std::string::npos) << r.out;
  }
}

TEST(Fp16, AnOverflowDropsTheLossScaleWhichThenRecovers) {
  const std::string policy = temp_path("ls.yaml");
  std::ofstream(policy) << "version: 1\nloss_scale:\n  growth_interval: 20\n";
  const std::string summary = temp_path("s.json");
  const std::string trace = temp_path("t.jsonl");
  const ProcessResult r =
      run_stepguard("demo --steps 80 --precision fp16 --inject overflow@30 --policy '" + policy +
                    "' --summary-json '" + summary + "' --trace '" + trace + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  std::map<int, nlohmann::json> by_step;
  std::ifstream in(trace);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    by_step[j["step"].get<int>()] = j;
  }
  ASSERT_EQ(by_step.size(), 80u);
  // GradScaler's rule with growth every 20 clean steps: x2 at step 20, the overflow at 30 skips
  // and halves, 20 clean steps later (step 50) it has grown back, and again at 70.
  EXPECT_EQ(by_step[19]["loss_scale"], 65536.0);
  EXPECT_EQ(by_step[20]["loss_scale"], 131072.0);
  EXPECT_EQ(by_step[30]["outcome"], "skipped");
  EXPECT_EQ(by_step[30]["actions"], nlohmann::json::array({"skip_batch", "drop_loss_scale"}));
  EXPECT_EQ(by_step[30]["loss_scale"], 65536.0);
  EXPECT_EQ(by_step[50]["loss_scale"], 131072.0);
  EXPECT_EQ(by_step[70]["loss_scale"], 262144.0);
  const auto s = read_json(summary);
  expect_summary(s, SummaryCheck().skipped(1).params_finite(true));
  EXPECT_EQ(s["precision"], "fp16");
  EXPECT_EQ(s["loss_scale"], 262144.0);
}

TEST(Fp16, OverflowWithoutFp16IsABadArgument) {
  const ProcessResult r = run_stepguard("demo --steps 3 --inject overflow@2");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--inject overflow: needs --precision fp16"), std::string::npos) << r.err;
}

TEST(ReplayCli, HandWrittenTraceAndBadArguments) {
  const std::string data = std::string(STEPGUARD_SOURCE_DIR) + "/tests/data/replay/";
  ProcessResult r =
      run_stepguard("replay --policy '" + data + "policy.yaml' --trace '" + data + "trace.jsonl'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto lines = json_lines(r.out);
  ASSERT_EQ(lines.size(), 14u);
  EXPECT_EQ(lines.back()["outcome"], "aborted");
  EXPECT_NE(r.err.find("aborted at step 14"), std::string::npos) << r.err;

  r = run_stepguard("replay --trace '" + data + "trace.jsonl'");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--policy and --trace are required"), std::string::npos) << r.err;
  r = run_stepguard("replay --policy '" + data + "trace.jsonl' --trace '" + data + "trace.jsonl'");
  EXPECT_EQ(r.status, 2);  // a trace is not a policy: FILE:LINE:COL lines
  EXPECT_NE(r.err.find("trace.jsonl:"), std::string::npos) << r.err;
  r = run_stepguard("replay --policy '" + data + "policy.yaml' --trace /nonexistent.jsonl");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("/nonexistent.jsonl: cannot read trace"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace demo_test
}  // namespace stepguard
