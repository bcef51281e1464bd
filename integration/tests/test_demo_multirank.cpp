// End-to-end: `stepguard demo --ranks R`, several ranks training data-parallel over Gloo on
// loopback: rank-local faults, killed ranks, a stopped launcher, rollbacks that keep the replicas
// equal, and incident reports that name the rank a fault came from.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "integration/tests/demo_support.h"

namespace stepguard {
namespace demo_test {
namespace {

TEST(MultiRank, RankLocalFaultsAreSkippedOnEveryRankAndReplicasStayEqual) {
  const std::string summary = temp_path("s.json");
  const std::string trace = temp_path("t.jsonl");
  const ProcessResult r = run_stepguard(
      "demo --ranks 4 --steps 120 --inject nan_grad@30:2 --inject inf_grad@70:1 "
      "--summary-json '" +
      summary + "' --trace '" + trace + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto s = read_json(summary);
  ASSERT_NO_FATAL_FAILURE(expect_summary(s, SummaryCheck()
                                                .ranks(4)
                                                .skipped(2)
                                                .applied(118)
                                                // one at construction (the ranks' layouts),
                                                // one a step, two more per incident, and two
                                                // for the blamed names of a NaN that stayed
                                                // on its rank (both faults are rank-local)
                                                .collectives(1 + 120 + 2 * 2 + 2 * 2)
                                                .step_buffer_bytes(296)  // the same at any size
                                                .params_finite(true)
                                                .outcomes_agree(true)
                                                .param_hashes(4)
                                                .replicas_equal()
                                                .learned()));
  ASSERT_EQ(s["incidents"].size(), 2u);
  EXPECT_EQ(s["incidents"][0]["step"], 30);
  EXPECT_EQ(s["incidents"][0]["ranks"], nlohmann::json::array({2}));
  EXPECT_EQ(s["incidents"][1]["step"], 70);
  EXPECT_EQ(s["incidents"][1]["ranks"], nlohmann::json::array({1}));
  // The faults land after the gradient average: only the faulty rank's gradients are bad, and
  // every rank reads that rank's own cause.
  EXPECT_EQ(s["incidents"][0]["rank_causes"], nlohmann::json({{"2", "backward"}}));

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

TEST(MultiRank, BrokenWeightsOnOneRankRollAllRanksBackToTheSameStep) {
  const std::string summary = temp_path("s.json");
  const std::string trace = temp_path("t.jsonl");
  const ProcessResult r =
      run_stepguard("demo --ranks 4 --steps 150 --inject corrupt_weights@120:2 --summary-json '" +
                    summary + "' --trace '" + trace + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  expect_summary(
      read_json(summary),
      SummaryCheck().rollbacks(1).params_finite(true).outcomes_agree(true).replicas_equal());
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
  // The drifted replica was rolled back: the replicas end equal.
  expect_summary(read_json(summary),
                 SummaryCheck().outcomes_agree(true).replicas_equal().step_buffer_bytes(296));
}

}  // namespace
}  // namespace demo_test
}  // namespace stepguard
