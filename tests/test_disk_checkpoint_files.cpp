// Disk checkpoints: atomic per-rank files with checksums and a manifest written last; every kind
// of damage is detected and the previous checkpoint is used; a writer killed at random points
// never leaves a newest checkpoint that loads wrong. Torch-free: also built with ASan/UBSan
// (tests/CMakeLists.txt, stepguard_sanitized_tests).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "csrc/checkpoint/disk_checkpoint.h"
#include "tests/support/fresh_dir.h"

namespace stepguard {
namespace {

namespace fs = std::filesystem;
using namespace checkpoint;

// A payload whose every byte depends on the step, so a mix-up shows.
std::string payload_for(std::int64_t step, std::size_t bytes = 4096) {
  std::string p(bytes, '\0');
  std::mt19937_64 gen(static_cast<std::uint64_t>(step));
  for (auto& c : p) c = static_cast<char>(gen());
  return p;
}

constexpr const char* kRun = "run-a";

void write_checkpoint(const std::string& root, std::int64_t step, int world, int keep,
                      std::size_t bytes = 4096, const std::string& run = kRun) {
  for (int r = 0; r < world; ++r) {
    write_rank_file(root, run, step, r, payload_for(step * 10 + r, bytes));
  }
  commit_checkpoint(root, run, step, world, keep);
}

TEST(DiskCheckpoint, WriteListVerifyAndKeepTheNewest) {
  const std::string root = fresh_dir("keep");
  for (std::int64_t step : {10, 20, 30, 40}) write_checkpoint(root, step, 2, 2);
  const auto entries = list_checkpoints(root);
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].step, 30);
  EXPECT_EQ(entries[1].step, 40);
  EXPECT_EQ(entries[1].world_size, 2);
  const VerifyReport v = verify_checkpoint(entries[1]);
  EXPECT_TRUE(v.ok());
  EXPECT_EQ(v.bytes, 2 * 4096);
  EXPECT_EQ(read_rank_file(entries[1], 1), payload_for(401));
  EXPECT_THROW(read_rank_file(entries[1], 2), CheckpointError);
  // No temporary files are left behind.
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
  }
}

TEST(DiskCheckpoint, AnIncompleteCheckpointIsIgnoredThenCleanedUp) {
  const std::string root = fresh_dir("incomplete");
  write_checkpoint(root, 10, 1, 3);
  write_rank_file(root, kRun, 20, 0, payload_for(200));  // pending: a crash before the commit
  EXPECT_FALSE(fs::exists(step_dir(root, 20)));          // never visible before its commit
  auto reports = verify_all(root);
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_FALSE(reports[1].complete);
  EXPECT_EQ(reports[1].problems[0],
            pending_dir(root, kRun, 20) +
                ": pending (written, never committed: waiting for the next step's confirmation, "
                "or left by a crash)");
  ASSERT_EQ(list_checkpoints(root).size(), 1u);
  EXPECT_EQ(list_checkpoints(root)[0].step, 10);
  EXPECT_EQ(list_checkpoints(root)[0].run, kRun);
  write_checkpoint(root, 30, 1, 3);
  EXPECT_FALSE(fs::exists(pending_dir(root, kRun, 20)));  // the run's stale one goes at the commit
}

// A new run in a directory that holds an older run's checkpoints of higher steps: its own new
// checkpoints are kept (pruning considers one run only) and the old run's are never touched.
TEST(DiskCheckpoint, PruningConsidersOnlyTheCommittingRun) {
  const std::string root = fresh_dir("runs");
  for (std::int64_t step : {80, 100, 120}) write_checkpoint(root, step, 1, 3, 4096, "old");
  for (std::int64_t step : {20, 40, 60, 70}) write_checkpoint(root, step, 1, 3, 4096, "new");
  std::vector<std::pair<std::string, std::int64_t>> seen;
  for (const auto& e : list_checkpoints(root)) seen.push_back({e.run, e.step});
  const std::vector<std::pair<std::string, std::int64_t>> expected = {
      {"new", 40}, {"new", 60}, {"new", 70}, {"old", 80}, {"old", 100}, {"old", 120}};
  EXPECT_EQ(seen, expected);
  EXPECT_EQ(runs_under(root), (std::vector<std::string>{"new", "old"}));
}

// The run went back (resumed from step 40 after 60 turned out unloadable): committing step 50
// removes the run's checkpoints of later steps, which would otherwise be resumed first.
TEST(DiskCheckpoint, ACommitSupersedesTheRunsLaterCheckpoints) {
  const std::string root = fresh_dir("supersede");
  for (std::int64_t step : {20, 40, 60}) write_checkpoint(root, step, 1, 5);
  write_checkpoint(root, 50, 1, 5);
  std::vector<std::int64_t> steps;
  for (const auto& e : list_checkpoints(root)) steps.push_back(e.step);
  EXPECT_EQ(steps, (std::vector<std::int64_t>{20, 40, 50}));
}

// A step directory that already holds a checkpoint (an abandoned timeline's step 60) is never
// rewritten in place: until the new step 60 is committed the old one stays whole, and after
// it every file is the new one's.
TEST(DiskCheckpoint, AStepDirectoryIsNeverRewrittenInPlace) {
  const std::string root = fresh_dir("rewrite");
  write_checkpoint(root, 60, 2, 3, 4096);
  write_rank_file(root, kRun, 60, 0, payload_for(999));
  write_rank_file(root, kRun, 60, 1, payload_for(998));
  ASSERT_EQ(list_checkpoints(root).size(), 1u);
  const CheckpointEntry old = list_checkpoints(root)[0];
  EXPECT_TRUE(verify_checkpoint(old).ok());
  EXPECT_EQ(read_rank_file(old, 0), payload_for(600));  // the new bytes are not visible yet
  commit_checkpoint(root, kRun, 60, 2, 3);
  const CheckpointEntry now = list_checkpoints(root).at(0);
  EXPECT_EQ(read_rank_file(now, 0), payload_for(999));
  EXPECT_EQ(read_rank_file(now, 1), payload_for(998));
  for (const auto& e : fs::directory_iterator(root)) {
    EXPECT_EQ(e.path().filename().string().find(".pending."), std::string::npos) << e.path();
    EXPECT_EQ(e.path().filename().string().find(".trash."), std::string::npos) << e.path();
  }
}

// A rank file of another run's checkpoint of the same step fails verification.
TEST(DiskCheckpoint, FilesOfAnotherRunAreNamed) {
  const std::string a = fresh_dir("run_a");
  const std::string b = fresh_dir("run_b");
  write_checkpoint(a, 10, 1, 3, 4096, "one");
  write_checkpoint(b, 10, 1, 3, 4096, "two");
  for (const char* f : {"/rank-00000.ckpt", "/rank-00000.json"}) {
    fs::copy_file(step_dir(b, 10) + f, step_dir(a, 10) + f, fs::copy_options::overwrite_existing);
  }
  const VerifyReport v = verify_checkpoint(list_checkpoints(a).at(0));
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.problems[0].find("rank-00000.json: belongs to run 'two', not run 'one'"),
            std::string::npos)
      << v.problems[0];
  EXPECT_THROW(write_rank_file(a, "bad run/../id", 1, 0, "x"), CheckpointError);
}

// Checkpoints written before run ids (format 1) are still listed, verified and loaded.
TEST(DiskCheckpoint, FormatOneCheckpointsAreStillRead) {
  const std::string root = fresh_dir("format1");
  write_checkpoint(root, 10, 1, 3);
  const std::string dir = step_dir(root, 10);
  std::ofstream(dir + "/MANIFEST.json")
      << R"({"format": 1, "step": 10, "world_size": 1, "writer": "stepguard"})";
  const auto entries = list_checkpoints(root);
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].run, "");
  EXPECT_TRUE(verify_checkpoint(entries[0]).ok());
  EXPECT_EQ(read_rank_file(entries[0], 0), payload_for(100));
}

// A step directory this user cannot read is a damaged checkpoint, not an incomplete one. As root
// (which reads everything) the check runs in a child that drops to an unprivileged user.
TEST(DiskCheckpoint, AnUnreadableStepDirectoryIsBadNotIncomplete) {
  const std::string root = fresh_dir("unreadable");
  write_checkpoint(root, 10, 1, 3);
  ::chmod(step_dir(root, 10).c_str(), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) ::_exit(2);
    const auto reports = verify_all(root);
    const bool named = reports.size() == 1 && reports[0].complete && !reports[0].ok() &&
                       reports[0].problems[0].find("Permission denied") != std::string::npos;
    if (!named && !reports.empty() && !reports[0].problems.empty()) {
      std::fprintf(stderr, "got: %s\n", reports[0].problems[0].c_str());
    }
    ::_exit(named ? 0 : 1);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  ::chmod(step_dir(root, 10).c_str(), 0755);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 2) GTEST_SKIP() << "cannot drop to an unprivileged user here";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// A writer SIGKILLed at random points, 30 times: the newest checkpoint that verifies always
// holds exactly the bytes written for its step, and verification never passes a damaged one.
// The kill points spread over a few checkpoint writes at this disk's speed: a write's fsyncs take
// from under a millisecond to 100 ms on a busy disk, and a fixed window shorter than one write
// let no checkpoint ever complete (the final check failed on a loaded build machine).
TEST(DiskCheckpoint, CrashTortureNeverLeavesANewestCheckpointThatLoadsWrong) {
  std::chrono::steady_clock::duration one_write{};
  {
    const std::string timing = fresh_dir("torture_timing");
    for (std::int64_t step = 1; step <= 3; ++step) {
      const auto start = std::chrono::steady_clock::now();
      write_checkpoint(timing, step, 2, 2, 256 * 1024);
      one_write = std::max(one_write, std::chrono::steady_clock::now() - start);
    }
  }
  const auto window_us = static_cast<std::uint32_t>(
      40000 + 3 * std::chrono::duration_cast<std::chrono::microseconds>(one_write).count());
  const std::string root = fresh_dir("torture");
  std::mt19937 rng(20261129);
  std::int64_t next_step = 1;
  for (int trial = 0; trial < 30; ++trial) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // Writes checkpoints of 2 ranks x 256 KiB as fast as it can, keeping 2. Never returns into
      // the test runner.
      try {
        for (std::int64_t step = next_step;; ++step) {
          write_checkpoint(root, step, 2, 2, 256 * 1024);
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "writer failed: %s\n", e.what());
      }
      ::_exit(3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(2000 + rng() % window_us));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status));
    const auto entries = list_checkpoints(root);
    for (const auto& report : verify_all(root)) {
      if (!report.complete) continue;  // a crash before its manifest: never loaded
      EXPECT_TRUE(report.ok()) << "trial " << trial << ": " << report.problems[0];
    }
    if (!entries.empty()) {
      const CheckpointEntry& newest = entries.back();
      for (int r = 0; r < 2; ++r) {
        ASSERT_EQ(read_rank_file(newest, r), payload_for(newest.step * 10 + r, 256 * 1024))
            << "trial " << trial << ", step " << newest.step;
      }
      next_step = newest.step + 100;  // the next child writes newer steps
    }
  }
  EXPECT_FALSE(list_checkpoints(root).empty());
}

// A rank whose write failed left no file: the commit refuses, and nothing becomes visible.
TEST(DiskCheckpoint, ACommitWithARankFileMissingIsRefused) {
  const std::string root = fresh_dir("missing_rank");
  write_checkpoint(root, 10, 2, 3);
  write_rank_file(root, kRun, 20, 0, payload_for(200));  // rank 1 never wrote
  try {
    commit_checkpoint(root, kRun, 20, 2, 3);
    FAIL() << "committed without rank 1";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(pending_dir(root, kRun, 20) +
                                         ": rank 1's file is missing or incomplete"),
              std::string::npos)
        << e.what();
  }
  ASSERT_EQ(list_checkpoints(root).size(), 1u);
  EXPECT_EQ(list_checkpoints(root)[0].step, 10);
}

// Ranks write in the background: when rank 0 commits step 20, another rank may already be
// writing step 30. The commit removes the run's pending directories of earlier steps only.
TEST(DiskCheckpoint, ACommitLeavesAPendingCheckpointOfALaterStepAlone) {
  const std::string root = fresh_dir("later_pending");
  write_rank_file(root, kRun, 10, 0, payload_for(100));  // never committed: a crash
  write_rank_file(root, kRun, 30, 1, payload_for(301));  // rank 1 already at step 30
  write_checkpoint(root, 20, 2, 3);
  EXPECT_FALSE(fs::exists(pending_dir(root, kRun, 10)));
  ASSERT_TRUE(fs::exists(pending_dir(root, kRun, 30)));
  write_rank_file(root, kRun, 30, 0, payload_for(300));
  commit_checkpoint(root, kRun, 30, 2, 3);
  const CheckpointEntry newest = list_checkpoints(root).back();
  EXPECT_EQ(newest.step, 30);
  EXPECT_EQ(read_rank_file(newest, 0), payload_for(300));
  EXPECT_EQ(read_rank_file(newest, 1), payload_for(301));
}

// A pending directory left by a crash holds rank 1's file of step 20. The resumed run writes
// step 20 again and rank 1's write fails this time: the commit must not take the earlier
// attempt's file for this one's.
TEST(DiskCheckpoint, AFailedRewriteNeverCommitsAnEarlierAttemptsFile) {
  const std::string root = fresh_dir("earlier_attempt");
  write_rank_file(root, kRun, 20, 0, payload_for(200));
  write_rank_file(root, kRun, 20, 1, payload_for(201));
  write_rank_file(root, kRun, 20, 0, payload_for(210));
  // Rank 1's new payload cannot even be started (a directory holds its temporary name): the
  // earlier attempt's file stays whole beside it.
  const std::string tmp =
      pending_dir(root, kRun, 20) + "/rank-00001.ckpt.tmp." + std::to_string(::getpid());
  fs::create_directories(tmp + "/in-the-way");
  EXPECT_THROW(write_rank_file(root, kRun, 20, 1, payload_for(211)), CheckpointError);
  fs::remove_all(tmp);
  try {
    commit_checkpoint(root, kRun, 20, 2, 3);
    FAIL() << "committed rank 1's earlier attempt";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1's file is missing or incomplete"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(list_checkpoints(root).empty());
}

// Deleting a pruned checkpoint takes a while: the engine leaves it to its writer thread. The
// commit has already hidden it (renamed out of sight, durably); nothing lists or loads it.
TEST(DiskCheckpoint, ACommitCanLeaveTheDeletionOfWhatItPrunedToTheCaller) {
  const std::string root = fresh_dir("deferred");
  write_checkpoint(root, 10, 1, 1);
  write_rank_file(root, kRun, 20, 0, payload_for(200));
  std::vector<std::string> hidden;
  commit_checkpoint(root, kRun, 20, 1, 1, &hidden);
  ASSERT_EQ(hidden.size(), 1u);
  EXPECT_TRUE(fs::exists(hidden[0]));
  EXPECT_FALSE(fs::exists(step_dir(root, 10)));
  ASSERT_EQ(list_checkpoints(root).size(), 1u);
  EXPECT_EQ(list_checkpoints(root)[0].step, 20);
  EXPECT_EQ(verify_all(root).size(), 1u);
  remove_hidden(hidden);
  EXPECT_FALSE(fs::exists(hidden[0]));
  std::size_t entries = 0;
  for (const auto& e : fs::directory_iterator(root)) entries += e.path().string().empty() ? 0 : 1;
  EXPECT_EQ(entries, 1u);  // step 20 alone
}

// A file far larger than its format allows (a sparse terabyte) is named and skipped, never
// read: the older checkpoint stays usable, and learning the directory's runs reads manifests only.
TEST(DiskCheckpoint, AnOversizedFileIsNamedAndSkippedWithoutReadingIt) {
  const std::string root = fresh_dir("oversized");
  write_checkpoint(root, 10, 2, 3);
  write_checkpoint(root, 20, 2, 3);
  write_checkpoint(root, 30, 2, 3);
  constexpr off_t kTerabyte = off_t{1} << 40;
  ASSERT_EQ(::truncate((step_dir(root, 30) + "/MANIFEST.json").c_str(), kTerabyte), 0);
  ASSERT_EQ(::truncate((step_dir(root, 20) + "/rank-00001.ckpt").c_str(), kTerabyte), 0);
  const auto entries = list_checkpoints(root);
  ASSERT_EQ(entries.size(), 2u);  // 30's manifest is refused
  EXPECT_EQ(entries[1].step, 20);
  const VerifyReport twenty = verify_checkpoint(entries[1]);
  ASSERT_EQ(twenty.problems.size(), 1u);
  EXPECT_NE(twenty.problems[0].find("rank-00001.ckpt: 1099511627776 bytes, more than the 4096 "
                                    "this file can hold"),
            std::string::npos)
      << twenty.problems[0];
  EXPECT_TRUE(verify_checkpoint(entries[0]).ok());  // step 10 loads
  bool named = false;
  for (const auto& report : verify_all(root)) {
    for (const auto& problem : report.problems) {
      named |= problem.find("MANIFEST.json: 1099511627776 bytes, more than the 1048576") !=
               std::string::npos;
    }
  }
  EXPECT_TRUE(named);
  EXPECT_EQ(runs_under(root), std::vector<std::string>{kRun});
}

TEST(DiskCheckpoint, UnwritableRootIsAClearError) {
  try {
    write_rank_file("/proc/stepguard-no", kRun, 1, 0, "x");
    FAIL();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("/proc/stepguard-no/step-000000001"), std::string::npos)
        << e.what();
  }
}

// A link planted at a file's name, or at its temporary's (PATH.tmp.<pid>: a predictable name),
// is never written through: the file outside stays as it was, the write lands in the directory.
TEST(AtomicWrite, APlantedSymlinkIsNeverWrittenThrough) {
  const std::string dir = fresh_dir("planted_links");
  const std::string outside = dir + "-outside";
  fs::remove(outside);
  { std::ofstream(outside) << "precious"; }
  const std::string path = dir + "/incident-step-000000003.json";
  fs::create_symlink(outside, path + ".tmp." + std::to_string(::getpid()));
  write_file_atomically(path, "report one\n");
  fs::create_symlink(outside, dir + "/rank-00000.ckpt.tmp." + std::to_string(::getpid()));
  fs::remove(path);
  fs::create_symlink(outside, path);  // at the name itself: replaced, not followed
  write_file_atomically(path, "report two\n");
  std::ifstream in(outside);
  std::string kept((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(kept, "precious");
  EXPECT_FALSE(fs::is_symlink(path));
  std::ifstream written(path);
  std::string text((std::istreambuf_iterator<char>(written)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "report two\n");
  fs::remove(outside);
}

}  // namespace
}  // namespace stepguard
