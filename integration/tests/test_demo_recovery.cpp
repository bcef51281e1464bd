// End-to-end: what `stepguard demo` recovers from and explains on one rank: the default policy's
// rollbacks (and offline replay agreeing with them), disk checkpoints and resume, and forensics
// (each injected fault's cause, incident reports, probes).
#include <gtest/gtest.h>

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "integration/tests/demo_support.h"

namespace stepguard {
namespace demo_test {
namespace {

// lr x 1000 for one step: real divergence (the loss jumps from ~2.5 to ~57 at the next step).
// The default policy sees the loss spike, rolls back to the last confirmed snapshot, skips 20
// batches and halves the LR for a while; training ends finite and learned. The same trace
// replayed offline through the same policy gives the same decision on every step.
// Early training is where runs blow up: an LR spike at step 60, long before the z-score's warm-up
// of 100 steps ends, is caught by the early ratio and rolled back to the snapshot of step 50.
TEST(DefaultPolicy, AnEarlyLrSpikeIsCaughtBeforeTheZScoreWarmsUp) {
  const std::string summary = temp_path("early.json");
  const std::string trace = temp_path("early.jsonl");
  const ProcessResult r = run_stepguard("demo --steps 120 --inject lr_spike@60 --summary-json '" +
                                        summary + "' --trace '" + trace + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto s = read_json(summary);
  expect_summary(s, SummaryCheck().rollbacks(1).params_finite(true));
  ASSERT_EQ(s["incidents"].size(), 1u) << s["incidents"].dump();
  const auto& inc = s["incidents"][0];
  EXPECT_EQ(inc["step"], 61);
  EXPECT_EQ(inc["signal"], "loss_spike");
  EXPECT_EQ(inc["action"], "rollback");
  EXPECT_EQ(inc["cause"], "divergence");
  const auto live = json_lines(slurp(trace));
  ASSERT_EQ(live.size(), 120u);
  EXPECT_EQ(live[60]["outcome"], "rolled_back");
  EXPECT_EQ(live[60]["rolled_back_to"], 50);
  for (std::size_t i = 0; i < 60; ++i) EXPECT_EQ(live[i]["outcome"], "applied") << i + 1;
}

TEST(DefaultPolicy, LrSpikeIsCaughtRolledBackAndReplayAgrees) {
  const std::string summary = temp_path("s.json");
  const std::string trace = temp_path("trace.jsonl");
  const ProcessResult r =
      run_stepguard("demo --steps 300 --inject nan_grad@60 --inject lr_spike@150 --summary-json '" +
                    summary + "' --trace '" + trace + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto s = read_json(summary);
  EXPECT_EQ(s["policy"], "configs/policies/default.yaml (built in)");
  expect_summary(s, SummaryCheck().rollbacks(1).params_finite(true).learned());
  EXPECT_EQ(s["batches_consumed"], 300 + 20);  // 20 skipped after the rollback
  bool caught = false;
  for (const auto& inc : s["incidents"]) {
    if (inc["step"] == 151) {
      caught = true;
      EXPECT_EQ(inc["signal"], "loss_spike");
      EXPECT_EQ(inc["action"], "rollback");
      EXPECT_EQ(inc["cause"], "divergence");
    }
  }
  EXPECT_TRUE(caught) << s["incidents"].dump();
  const auto live = json_lines(slurp(trace));
  ASSERT_EQ(live.size(), 300u);
  EXPECT_EQ(live[150]["outcome"], "rolled_back");
  EXPECT_EQ(live[150]["rolled_back_to"], 100);  // the snapshot of step 150 was the suspect
  EXPECT_EQ(live[150]["lr_factor"], 0.5);

  const ProcessResult rr = run_stepguard("replay --policy '" + std::string(STEPGUARD_SOURCE_DIR) +
                                         "/configs/policies/default.yaml' --trace '" + trace + "'");
  ASSERT_EQ(rr.status, 0) << rr.err;
  const auto replayed = json_lines(rr.out);
  ASSERT_EQ(replayed.size(), live.size());
  for (std::size_t i = 0; i < live.size(); ++i) {
    for (const char* key :
         {"step", "outcome", "actions", "loss_scale", "lr_factor", "batches_to_skip"}) {
      ASSERT_EQ(replayed[i][key], live[i][key]) << "step " << i + 1 << ", " << key;
    }
    ASSERT_EQ(replayed[i].value("rolled_back_to", 0), live[i].value("rolled_back_to", 0));
  }
  EXPECT_NE(rr.err.find("replayed 300 steps"), std::string::npos) << rr.err;
}

TEST(DefaultPolicy, BrokenWeightsAreRolledBackInProcess) {
  const std::string summary = temp_path("s.json");
  const ProcessResult r = run_stepguard(
      "demo --steps 400 --inject corrupt_weights@150 "
      "--summary-json '" +
      summary + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  expect_summary(read_json(summary), SummaryCheck().min_rollbacks(1).params_finite(true).learned());
  EXPECT_NE(r.out.find("rollbacks        1"), std::string::npos) << r.out;
}

// The acceptance run: a weight goes NaN at step 150; the guard rolls back in-process,
// checkpoints keep being written, and every checkpoint verifies.
TEST(Checkpoints, CorruptWeightsWithCheckpointsRollsBackAndVerifies) {
  const std::string dir = temp_path("ck");
  std::filesystem::remove_all(dir);
  const std::string summary = temp_path("s.json");
  ProcessResult r =
      run_stepguard("demo --steps 400 --inject corrupt_weights@150 --checkpoint-dir '" + dir +
                    "' --summary-json '" + summary + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto s = read_json(summary);
  expect_summary(s, SummaryCheck().min_rollbacks(1).params_finite(true).learned());
  EXPECT_GE(s["checkpoints"], 7);
  r = run_stepguard("ckpt verify '" + dir + "'");
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("3 valid, 0 bad"), std::string::npos) << r.out;  // the newest 3 are kept
  r = run_stepguard("ckpt ls '" + dir + "'");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("400"), std::string::npos) << r.out;

  // A flipped byte in the newest checkpoint: verify names the file and fails.
  const std::string victim = dir + "/step-000000400/rank-00000.ckpt";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(4000);
    char c = 0;
    f.get(c);
    f.seekp(4000);
    f.put(static_cast<char>(c ^ 0x01));
  }
  r = run_stepguard("ckpt verify '" + dir + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(victim + ": checksum"), std::string::npos) << r.err;
  r = run_stepguard("ckpt verify /nonexistent-ckpt-dir");
  EXPECT_EQ(r.status, 2);
}

// Killed at step 130 (SIGKILL, no goodbye), resumed from the newest valid checkpoint: the run
// ends with the same parameters, bitwise, as one that was never interrupted. One torch thread
// (as Demo.SameSeedSameParameters: two threads' CPU kernels vary in the last bit run to run).
TEST(Checkpoints, ResumeAfterAKillMatchesAnUninterruptedRun) {
  const std::string a = temp_path("ckA"), b = temp_path("ckB");
  std::filesystem::remove_all(a);
  std::filesystem::remove_all(b);
  const std::string sa = temp_path("a.json"), sb = temp_path("b.json");
  ProcessResult r = run_stepguard("demo --steps 200 --threads 1 --checkpoint-dir '" + a +
                                  "' --summary-json '" + sa + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  r = run_stepguard("demo --steps 200 --threads 1 --inject kill@130 --checkpoint-dir '" + b + "'");
  ASSERT_EQ(r.status, 128 + 9) << r.err;
  r = run_stepguard("demo --steps 200 --threads 1 --resume '" + b + "' --summary-json '" + sb +
                    "'");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("resumed from " + b + "/step-000000100 (step 100, data position 100)"),
            std::string::npos)
      << r.err;
  const auto ja = read_json(sa), jb = read_json(sb);
  EXPECT_EQ(jb["resumed_from"], 100);
  EXPECT_EQ(jb["steps"], 200);
  EXPECT_EQ(jb["param_hashes"], ja["param_hashes"]);
  EXPECT_EQ(jb["batches_consumed"], ja["batches_consumed"]);
}

// Every injected fault class gets the cause the debugging order gives it, with a report on disk.
// --probe: the report names the first block whose output went bad (the corrupted weight sits in
// blocks.0), as probes do in a user's model.
TEST(Forensics, ProbesNameTheFirstBadBlockInTheDemo) {
  const std::string summary = temp_path("probe.json");
  const ProcessResult r = run_stepguard(
      "demo --steps 8 --probe --inject corrupt_weights@5 "
      "--summary-json '" +
      summary + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto s = read_json(summary);
  ASSERT_FALSE(s["incidents"].empty());
  const auto& inc = s["incidents"][0];
  EXPECT_EQ(inc["step"], 5);
  EXPECT_EQ(inc["cause"], "forward");
  bool named = false;
  for (const auto& e : inc["evidence"]) {
    named =
        named || e.get<std::string>() == "the first non-finite output in forward order: blocks.0";
  }
  EXPECT_TRUE(named) << inc["evidence"].dump();
  const ProcessResult bad = run_stepguard("demo --probe=yes");
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.err.find("--probe 'yes': takes no value"), std::string::npos) << bad.err;
}

TEST(Forensics, EachInjectedFaultIsClassifiedAndReported) {
  const std::string dir = temp_path("incidents");
  std::filesystem::remove_all(dir);
  const std::string summary = temp_path("s.json");
  ProcessResult r = run_stepguard(
      "demo --steps 60 --inject nan_input@10 --inject nan_grad@20 --inject transient_nan@30 "
      "--inject nan_loss@40 --inject corrupt_weights@55 --incident-dir '" +
      dir + "' --summary-json '" + summary + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto s = read_json(summary);
  std::map<int, nlohmann::json> by_step;
  for (const auto& inc : s["incidents"]) by_step[inc["step"].get<int>()] = inc;
  ASSERT_TRUE(by_step.count(10) && by_step.count(20) && by_step.count(30) && by_step.count(40) &&
              by_step.count(55))
      << s["incidents"].dump();
  EXPECT_EQ(by_step[10]["cause"], "data");
  EXPECT_EQ(by_step[20]["cause"], "backward");
  EXPECT_EQ(by_step[20]["tensors"][0], "blocks.1.qkv.weight");
  EXPECT_EQ(by_step[30]["cause"], "hardware_suspect");
  EXPECT_EQ(by_step[40]["cause"], "forward");
  EXPECT_EQ(by_step[55]["cause"], "forward");
  EXPECT_NE(by_step[55]["evidence"][0].get<std::string>().find("parameters hold NaN/Inf"),
            std::string::npos);
  // The report files: JSON, Markdown, and the batch saved for replay.
  const std::string base = dir + "/incident-step-000000010";
  EXPECT_TRUE(std::filesystem::exists(base + ".json"));
  EXPECT_TRUE(std::filesystem::exists(base + ".md"));
  EXPECT_TRUE(std::filesystem::exists(base + ".batch.pt"));
  EXPECT_EQ(by_step[10]["report"], base + ".json");
  r = run_stepguard("incident show '" + base + ".json'");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("# Incident at step 10: data"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("## Try first"), std::string::npos) << r.out;
  r = run_stepguard("incident show '" + summary + "'");
  EXPECT_EQ(r.status, 2);  // a summary is not an incident report
  EXPECT_NE(r.err.find("not an incident report"), std::string::npos) << r.err;
}

TEST(Forensics, Fp16OverflowIsPrecisionOverflow) {
  const std::string summary = temp_path("s.json");
  ProcessResult r = run_stepguard(
      "demo --steps 40 --precision fp16 --inject overflow@30 "
      "--summary-json '" +
      summary + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto s = read_json(summary);
  ASSERT_EQ(s["incidents"].size(), 1u) << s["incidents"].dump();
  EXPECT_EQ(s["incidents"][0]["cause"], "precision_overflow") << s["incidents"].dump();
}

}  // namespace
}  // namespace demo_test
}  // namespace stepguard
