// End-to-end: the real `stepguard demo` binary trains the demo model with injected faults; the
// assertions read its summary JSON and trace, as a user's script would.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>
#include <csignal>
#include <thread>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

namespace {

struct ProcessResult {
  int status = -1;  // exit status, or 128 + signal
  std::string out;
  std::string err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string temp_path(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return ::testing::TempDir() + "/sg_" + info->name() + "_" + name;
}

ProcessResult run_stepguard(const std::string& args) {
  const std::string out = temp_path("stdout"), err = temp_path("stderr");
  const std::string cmd =
      std::string("'") + STEPGUARD_BIN + "' " + args + " >'" + out + "' 2>'" + err + "' </dev/null";
  const int raw = std::system(cmd.c_str());
  ProcessResult r;
  if (WIFEXITED(raw)) {
    r.status = WEXITSTATUS(raw);
    // /bin/sh reports a child killed by a signal as 128 + signal.
  } else if (WIFSIGNALED(raw)) {
    r.status = 128 + WTERMSIG(raw);
  }
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(slurp(path)); }

TEST(Demo, TwoInjectedGradientFaultsAreSkippedAndTrainingLearns) {
  const std::string summary = temp_path("s.json");
  const std::string trace = temp_path("trace.jsonl");
  const ProcessResult r = run_stepguard(
      "demo --steps 300 --inject nan_grad@50 --inject inf_grad@120 "
      "--summary-json '" +
      summary + "' --trace '" + trace + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto s = read_json(summary);
  EXPECT_EQ(s["steps"], 300);
  EXPECT_EQ(s["skipped"], 2);
  EXPECT_EQ(s["applied"], 298);
  EXPECT_EQ(s["rollbacks"], 0);
  EXPECT_EQ(s["aborted"], false);
  EXPECT_EQ(s["params_finite"], true);
  ASSERT_EQ(s["param_hashes"].size(), 1u);
  EXPECT_EQ(s["collectives"], 300);
  const double initial = s["initial_loss"], final_loss = s["final_loss"];
  EXPECT_LT(final_loss, 0.8 * initial) << "initial " << initial << " final " << final_loss;
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
  EXPECT_EQ(s["skipped"], 2);
  EXPECT_EQ(s["applied"], 28);
  EXPECT_EQ(s["params_finite"], true);
  ASSERT_EQ(s["incidents"].size(), 2u);
  EXPECT_EQ(s["incidents"][0]["step"], 10);
  EXPECT_EQ(s["incidents"][1]["step"], 20);
}

TEST(Demo, SameSeedSameParameters) {
  const std::string a = temp_path("a.json"), b = temp_path("b.json");
  ASSERT_EQ(run_stepguard("demo --steps 12 --seed 5 --inject nan_grad@4 --summary-json '" + a + "'")
                .status,
            0);
  ASSERT_EQ(run_stepguard("demo --steps 12 --seed 5 --inject nan_grad@4 --summary-json '" + b + "'")
                .status,
            0);
  EXPECT_EQ(read_json(a)["param_hashes"], read_json(b)["param_hashes"]);
}

TEST(Demo, CorruptWeightsWithoutRollbackAbortsAtTheBadStepLimit) {
  const std::string summary = temp_path("s.json");
  const ProcessResult r = run_stepguard(
      "demo --steps 40 --inject corrupt_weights@5 --max-bad-steps 6 "
      "--summary-json '" +
      summary + "'");
  EXPECT_EQ(r.status, 3) << r.err;
  const auto s = read_json(summary);
  EXPECT_EQ(s["aborted"], true);
  EXPECT_EQ(s["steps"], 10);  // bad from step 5 on: the 6th bad step in a row aborts
  EXPECT_EQ(s["params_finite"], false);
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
  const ProcessResult r = run_stepguard("demo --steps 2 --trace /nonexistent-dir/t.jsonl");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("cannot open event log '/nonexistent-dir/t.jsonl'"), std::string::npos)
      << r.err;
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

}  // namespace

namespace {

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
                       bad + ":4:3: unknown key 'bogus' in 'limits'\n");

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
  EXPECT_EQ(read_json(summary)["steps"], 6);
}

}  // namespace

namespace {

// Processes whose command line contains `needle` (read from /proc, so no helper matches itself).
int processes_mentioning(const std::string& needle) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "cmdline", std::ios::binary);
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmdline.find(needle) != std::string::npos) ++count;
  }
  return count;
}

std::vector<std::string> outcomes_in(const std::string& trace) {
  std::ifstream in(trace);
  std::vector<std::string> outcomes;
  std::string line;
  while (std::getline(in, line)) outcomes.push_back(nlohmann::json::parse(line)["outcome"]);
  return outcomes;
}

TEST(MultiRank, RankLocalFaultsAreSkippedOnEveryRankAndReplicasStayEqual) {
  const std::string summary = temp_path("s.json");
  const std::string trace = temp_path("t.jsonl");
  const ProcessResult r = run_stepguard(
      "demo --ranks 4 --steps 120 --inject nan_grad@30:2 --inject inf_grad@70:1 "
      "--summary-json '" +
      summary + "' --trace '" + trace + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto s = read_json(summary);
  EXPECT_EQ(s["ranks"], 4);
  EXPECT_EQ(s["skipped"], 2);
  EXPECT_EQ(s["applied"], 118);
  EXPECT_EQ(s["collectives"], 120 + 2 * 2);  // two more on each incident step
  EXPECT_EQ(s["step_buffer_bytes"], 232);    // the same at any world size
  EXPECT_EQ(s["params_finite"], true);
  EXPECT_EQ(s["outcomes_agree"], true);
  ASSERT_EQ(s["param_hashes"].size(), 4u);
  for (const auto& h : s["param_hashes"]) EXPECT_EQ(h, s["param_hashes"][0]);
  ASSERT_EQ(s["incidents"].size(), 2u);
  EXPECT_EQ(s["incidents"][0]["step"], 30);
  EXPECT_EQ(s["incidents"][0]["ranks"], nlohmann::json::array({2}));
  EXPECT_EQ(s["incidents"][1]["step"], 70);
  EXPECT_EQ(s["incidents"][1]["ranks"], nlohmann::json::array({1}));
  // The faults land after the gradient average: only the faulty rank's gradients are bad, and
  // every rank reads that rank's own cause.
  EXPECT_EQ(s["incidents"][0]["rank_causes"], nlohmann::json({{"2", "backward"}}));
  EXPECT_LT(s["final_loss"].get<double>(), 0.8 * s["initial_loss"].get<double>());

  // Every rank's own trace shows the same outcome on every step.
  const auto rank0 = outcomes_in(trace);
  ASSERT_EQ(rank0.size(), 120u);
  EXPECT_EQ(rank0[29], "skipped");
  EXPECT_EQ(rank0[69], "skipped");
  for (int rank = 1; rank < 4; ++rank) {
    EXPECT_EQ(outcomes_in(trace + ".rank" + std::to_string(rank)), rank0) << "rank " << rank;
  }
}

// Four ranks, rank 2 killed in step 5 (in the guard's collective, and before the loop's own
// gradient all-reduce): its ring neighbours (1, 3) fail at once, rank 0 would wait out the
// deadline but learns of the failure through the store; every survivor names exactly rank 2 (a
// live rank used to be blamed, and the gradient all-reduce named no rank), and all exit well
// within the deadline counted from the kill.
void killed_rank_is_named(const std::string& kind, const std::string& collective);

TEST(MultiRank, AKilledRankMakesTheOthersExitWithinTheDeadlineNamingStepAndRank) {
  for (const std::string kind : {"kill", "kill_early"}) {
    SCOPED_TRACE(kind);
    killed_rank_is_named(kind, kind == "kill" ? "all-reduce" : "gradient all-reduce");
  }
}

void killed_rank_is_named(const std::string& kind, const std::string& collective) {
  const std::string marker = temp_path("kill_marker_" + kind + ".jsonl");  // to find stragglers
  std::filesystem::remove(marker);
  ProcessResult r;
  std::atomic<bool> done{false};
  std::thread runner([&] {
    r = run_stepguard("demo --ranks 4 --steps 40 --batch-size 8 --inject " + kind +
                      "@5:2 --collective-timeout 30 --trace '" + marker + "'");
    done = true;
  });
  // The event: rank 0 has finished step 4 (its trace has four lines); the kill follows in step 5.
  auto lines = [&] {
    const std::string t = slurp(marker);
    return std::count(t.begin(), t.end(), '\n');
  };
  while (!done && lines() < 4) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto event = std::chrono::steady_clock::now();
  runner.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - event).count();
  EXPECT_EQ(r.status, 1) << r.err;
  // Well under the 30 s deadline: a second to learn of the failure, 5 s of check-in grace.
  EXPECT_LT(seconds, 20.0) << r.err;
  EXPECT_NE(r.err.find("rank 2 was killed by signal 9"), std::string::npos) << r.err;
  for (int rank : {0, 1, 3}) {
    const std::string prefix = "[rank " + std::to_string(rank) + "] stepguard: rank " +
                               std::to_string(rank) + ": the step 5 " + collective + " over gloo";
    const auto at = r.err.find(prefix);
    ASSERT_NE(at, std::string::npos) << r.err;
    const std::string line = r.err.substr(at, r.err.find('\n', at) - at);
    EXPECT_NE(line.find("; missing rank 2 ("), std::string::npos) << line;
    EXPECT_EQ(line.find("unreachable"), std::string::npos) << line;
    EXPECT_NE(r.err.find("rank " + std::to_string(rank) + " exited with status 1"),
              std::string::npos)
        << r.err;
  }
  // No rank is left behind.
  EXPECT_EQ(processes_mentioning(marker), 0);
}

TEST(MultiRank, SigtermToTheLauncherStopsEveryRank) {
  const std::string marker = temp_path("sigterm_marker.jsonl");
  const std::string first_trace = marker;  // rank 0 writes the path as given
  // A trace left by an earlier run would look like a run in progress.
  std::filesystem::remove(marker);
  std::filesystem::remove(marker + ".rank1");
  const pid_t launcher = ::fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    ::freopen("/dev/null", "w", stderr);
    ::execl(STEPGUARD_BIN, STEPGUARD_BIN, "demo", "--ranks", "2", "--steps", "100000",
            "--batch-size", "4", "--trace", marker.c_str(), static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  // Wait until rank 0 trains (its trace has a line): then the launcher is mid-run.
  const auto started = std::chrono::steady_clock::now();
  while (slurp(first_trace).find('\n') == std::string::npos &&
         std::chrono::steady_clock::now() - started < std::chrono::seconds(300)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_NE(slurp(first_trace).find('\n'), std::string::npos) << "the ranks never started";
  ASSERT_EQ(::kill(launcher, SIGTERM), 0);
  // Deadlines count from the signal.
  const auto signalled = std::chrono::steady_clock::now();
  int status = 0;
  while (::waitpid(launcher, &status, WNOHANG) == 0 &&
         std::chrono::steady_clock::now() - signalled < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(WIFEXITED(status)) << "the launcher did not exit within 30 s of SIGTERM";
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  while (processes_mentioning(marker) > 0 &&
         std::chrono::steady_clock::now() - signalled < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(processes_mentioning(marker), 0) << "ranks left training as orphans";
}

TEST(MultiRank, InjectionOnARankThatDoesNotExistIsABadArgument) {
  const ProcessResult r = run_stepguard("demo --steps 3 --inject nan_grad@2:3");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "stepguard demo: --inject nan_grad@2:3: rank 3 does not exist (1 rank)\n");
}

}  // namespace

namespace {

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
  EXPECT_EQ(s["skipped"], 1);
  EXPECT_EQ(s["precision"], "fp16");
  EXPECT_EQ(s["loss_scale"], 262144.0);
  EXPECT_EQ(s["params_finite"], true);
}

TEST(Fp16, OverflowWithoutFp16IsABadArgument) {
  const ProcessResult r = run_stepguard("demo --steps 3 --inject overflow@2");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--inject overflow: needs --precision fp16"), std::string::npos) << r.err;
}

}  // namespace

namespace stepguard {
namespace {

std::vector<nlohmann::json> json_lines(const std::string& text) {
  std::vector<nlohmann::json> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

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
  EXPECT_EQ(s["rollbacks"], 1);
  EXPECT_EQ(s["params_finite"], true);
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
  EXPECT_EQ(s["rollbacks"], 1);
  EXPECT_EQ(s["params_finite"], true);
  EXPECT_LT(s["final_loss"].get<double>(), 0.8 * s["initial_loss"].get<double>());
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
  const auto s = read_json(summary);
  EXPECT_GE(s["rollbacks"], 1);
  EXPECT_EQ(s["params_finite"], true);
  EXPECT_LT(s["final_loss"].get<double>(), 0.8 * s["initial_loss"].get<double>());
  EXPECT_NE(r.out.find("rollbacks        1"), std::string::npos) << r.out;
}

TEST(MultiRank, BrokenWeightsOnOneRankRollAllRanksBackToTheSameStep) {
  const std::string summary = temp_path("s.json");
  const std::string trace = temp_path("t.jsonl");
  const ProcessResult r =
      run_stepguard("demo --ranks 4 --steps 150 --inject corrupt_weights@120:2 --summary-json '" +
                    summary + "' --trace '" + trace + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto s = read_json(summary);
  EXPECT_EQ(s["rollbacks"], 1);
  EXPECT_EQ(s["params_finite"], true);
  EXPECT_EQ(s["outcomes_agree"], true);
  for (const auto& h : s["param_hashes"]) EXPECT_EQ(h, s["param_hashes"][0]);
  for (int rank = 0; rank < 4; ++rank) {
    const auto lines =
        json_lines(slurp(rank == 0 ? trace : trace + ".rank" + std::to_string(rank)));
    ASSERT_EQ(lines.size(), 150u) << rank;
    // The replica check on the step after the incident sees rank 2's weights differ from the
    // others' (a diverged replica): the default policy rolls back then, without waiting for the
    // 5th bad step in a row, to the snapshot of step 100 (checked equal at step 101).
    EXPECT_EQ(lines[120]["outcome"], "rolled_back") << rank;
    EXPECT_EQ(lines[120]["rolled_back_to"], 100) << rank;
    EXPECT_EQ(lines[120]["diverged_replicas"], nlohmann::json::array({2})) << rank;
  }
}

// Four ranks, data parallel: a fault before the gradient average (a NaN loss, a NaN input)
// reaches every rank's gradients, yet every rank's report names the rank it came from and that
// rank's cause, not a hardware suspect from its own clean replay; a transient fault on one rank
// stays a hardware suspect there; a finite drift of one replica is named at the next replica check
// and rolled back.
TEST(MultiRank, EveryRanksReportNamesTheOriginAndTheAgreedCause) {
  const std::string dir = temp_path("origin");
  std::filesystem::remove_all(dir);
  const std::string summary = temp_path("s.json");
  const ProcessResult r = run_stepguard(
      "demo --ranks 4 --steps 110 --batch-size 8 --inject nan_loss@20:3 --inject nan_input@40:1 "
      "--inject transient_nan@60:2 --inject drift_weights@70:1 --incident-dir '" +
      dir + "/inc' --summary-json '" + summary + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  struct Expected {
    int step;
    const char* signal;
    int origin;
    const char* cause;
  };
  const Expected expected[] = {{20, "nonfinite_loss", 3, "forward"},
                               {40, "nonfinite_loss", 1, "data"},
                               {60, "nonfinite_grad", 2, "hardware_suspect"},
                               {100, "replica_divergence", 1, "hardware_suspect"}};
  for (int rank = 0; rank < 4; ++rank) {
    for (const Expected& e : expected) {
      char name[96];
      std::snprintf(name, sizeof name, "/inc/rank-%d-incident-step-%09d.json", rank, e.step);
      SCOPED_TRACE(std::string(name));
      const auto report = read_json(dir + name);
      EXPECT_EQ(report["signal"], e.signal);
      EXPECT_EQ(report["ranks"], nlohmann::json::array({e.origin}));
      EXPECT_EQ(report["cause"], e.cause);
      EXPECT_EQ(report["rank_causes"], nlohmann::json({{std::to_string(e.origin), e.cause}}));
    }
  }
  const auto s = read_json(summary);
  EXPECT_EQ(s["outcomes_agree"], true);
  for (const auto& h : s["param_hashes"]) EXPECT_EQ(h, s["param_hashes"][0]);  // rolled back
  EXPECT_EQ(s["step_buffer_bytes"], 232);
}

// The issue's acceptance run: a weight goes NaN at step 150; the guard rolls back in-process,
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
  EXPECT_GE(s["rollbacks"], 1);
  EXPECT_EQ(s["params_finite"], true);
  EXPECT_LT(s["final_loss"].get<double>(), 0.8 * s["initial_loss"].get<double>());
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
// ends with the same parameters, bitwise, as one that was never interrupted.
TEST(Checkpoints, ResumeAfterAKillMatchesAnUninterruptedRun) {
  const std::string a = temp_path("ckA"), b = temp_path("ckB");
  std::filesystem::remove_all(a);
  std::filesystem::remove_all(b);
  const std::string sa = temp_path("a.json"), sb = temp_path("b.json");
  ProcessResult r =
      run_stepguard("demo --steps 200 --checkpoint-dir '" + a + "' --summary-json '" + sa + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  r = run_stepguard("demo --steps 200 --inject kill@130 --checkpoint-dir '" + b + "'");
  ASSERT_EQ(r.status, 128 + 9) << r.err;
  r = run_stepguard("demo --steps 200 --resume '" + b + "' --summary-json '" + sb + "'");
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

}  // namespace
}  // namespace stepguard
