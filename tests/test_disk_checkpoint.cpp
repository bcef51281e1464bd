// Disk checkpoints: atomic per-rank files with checksums and a manifest written last; every kind
// of damage is detected and the previous checkpoint is used; a writer killed at random points
// never leaves a newest checkpoint that loads wrong; the guard resumes bitwise.
#include <gtest/gtest.h>
#include <signal.h>
#include <stepguard/stepguard.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "csrc/checkpoint/disk_checkpoint.h"
#include "tests/support/model_fixture.h"

namespace stepguard {
namespace {

namespace fs = std::filesystem;
using namespace checkpoint;

std::string fresh_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/sg_ckpt_" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A payload whose every byte depends on the step, so a mix-up shows.
std::string payload_for(std::int64_t step, std::size_t bytes = 4096) {
  std::string p(bytes, '\0');
  std::mt19937_64 gen(static_cast<std::uint64_t>(step));
  for (auto& c : p) c = static_cast<char>(gen());
  return p;
}

void write_checkpoint(const std::string& root, std::int64_t step, int world, int keep,
                      std::size_t bytes = 4096) {
  for (int r = 0; r < world; ++r) write_rank_file(root, step, r, payload_for(step * 10 + r, bytes));
  commit_checkpoint(root, step, world, keep);
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
  write_rank_file(root, 20, 0, payload_for(200));  // no manifest: a crash before the commit
  auto reports = verify_all(root);
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_FALSE(reports[1].complete);
  EXPECT_EQ(reports[1].problems[0], step_dir(root, 20) +
                                        "/MANIFEST.json: missing (the checkpoint "
                                        "was never completed)");
  ASSERT_EQ(list_checkpoints(root).size(), 1u);
  EXPECT_EQ(list_checkpoints(root)[0].step, 10);
  write_checkpoint(root, 30, 1, 3);
  EXPECT_FALSE(fs::exists(step_dir(root, 20)));  // an older incomplete one goes at the commit
}

// Every kind of damage, detected and named.
TEST(DiskCheckpoint, DamageIsDetectedAndNamed) {
  struct Damage {
    const char* name;
    std::function<void(const std::string&)> apply;
    std::string expected_suffix;
  };
  const std::vector<Damage> cases = {
      {"truncated", [](const std::string& d) { fs::resize_file(d + "/rank-00001.ckpt", 100); },
       "/rank-00001.ckpt: 100 bytes, expected 4096 (truncated or overwritten)"},
      {"flipped byte",
       [](const std::string& d) {
         std::fstream f(d + "/rank-00000.ckpt", std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(1234);
         char c = 0;
         f.seekg(1234);
         f.get(c);
         f.seekp(1234);
         f.put(static_cast<char>(c ^ 0x10));
       },
       " (corrupted)"},
      {"missing rank file", [](const std::string& d) { fs::remove(d + "/rank-00001.ckpt"); },
       "/rank-00001.ckpt: missing"},
      {"missing record", [](const std::string& d) { fs::remove(d + "/rank-00000.json"); },
       "/rank-00000.json: missing"},
      {"garbled manifest",
       [](const std::string& d) { std::ofstream(d + "/MANIFEST.json") << "{\"format\": "; },
       "/MANIFEST.json: unreadable manifest"},
      // A FIFO must not block a reader (it did: open() waited for a writer forever).
      {"fifo for a rank file",
       [](const std::string& d) {
         fs::remove(d + "/rank-00001.ckpt");
         ASSERT_EQ(::mkfifo((d + "/rank-00001.ckpt").c_str(), 0600), 0);
       },
       "/rank-00001.ckpt: a FIFO, not a regular file"},
      {"fifo for the manifest",
       [](const std::string& d) {
         fs::remove(d + "/MANIFEST.json");
         ASSERT_EQ(::mkfifo((d + "/MANIFEST.json").c_str(), 0600), 0);
       },
       "/MANIFEST.json: a FIFO, not a regular file"},
      {"directory for a record",
       [](const std::string& d) {
         fs::remove(d + "/rank-00000.json");
         fs::create_directory(d + "/rank-00000.json");
       },
       "/rank-00000.json: a directory, not a file"},
      // A huge world size used to loop a billion times (and was truncated to int).
      {"world size out of range",
       [](const std::string& d) {
         std::ofstream(d + "/MANIFEST.json")
             << R"({"format": 1, "step": 20, "world_size": 99999999999, "writer": "stepguard"})";
       },
       "/MANIFEST.json: world_size 99999999999 is out of range (1 to 1048576)"},
      {"files of another step",
       [](const std::string& d) {
         const std::string older = fs::path(d).parent_path().string() + "/step-000000010";
         for (const char* f : {"/rank-00000.ckpt", "/rank-00000.json"}) {
           fs::copy_file(older + f, d + f, fs::copy_options::overwrite_existing);
         }
       },
       "/rank-00000.json: belongs to step 10, rank 0, not step 20, rank 0"},
  };
  for (const auto& c : cases) {
    const std::string root = fresh_dir("damage");
    write_checkpoint(root, 10, 2, 3);
    write_checkpoint(root, 20, 2, 3);
    c.apply(step_dir(root, 20));
    const auto reports = verify_all(root);
    ASSERT_EQ(reports.size(), 2u) << c.name;
    EXPECT_TRUE(reports[0].ok()) << c.name;
    ASSERT_FALSE(reports[1].ok()) << c.name;
    EXPECT_TRUE(reports[1].complete) << c.name;
    const std::string& p = reports[1].problems[0];
    EXPECT_EQ(p.rfind(step_dir(root, 20), 0), 0u) << c.name << ": " << p;
    EXPECT_NE(p.find(c.expected_suffix), std::string::npos) << c.name << ": " << p;
  }
}

// A writer SIGKILLed at random points, 30 times: the newest checkpoint that verifies always
// holds exactly the bytes written for its step, and verification never passes a damaged one.
TEST(DiskCheckpoint, CrashTortureNeverLeavesANewestCheckpointThatLoadsWrong) {
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
    std::this_thread::sleep_for(std::chrono::microseconds(2000 + rng() % 40000));
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

TEST(DiskCheckpoint, UnwritableRootIsAClearError) {
  try {
    write_rank_file("/proc/stepguard-no", 1, 0, "x");
    FAIL();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("/proc/stepguard-no/step-000000001"), std::string::npos)
        << e.what();
  }
}

// Trains `steps` steps through a guard that checkpoints every 3 steps into `dir`; returns the
// parameters after every step.
std::vector<std::vector<torch::Tensor>> train_with_checkpoints(const std::string& dir,
                                                               std::int64_t steps) {
  auto model = make_model(21);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(opt, GuardOptions().checkpoint_dir(dir).checkpoint_every(3));
  std::vector<std::vector<torch::Tensor>> after;
  for (std::int64_t step = 1; step <= steps; ++step) {
    opt.zero_grad();
    auto loss = loss_of(model, step);
    loss.backward();
    EXPECT_TRUE(guard.step(loss).applied());
    after.push_back(clone_all(model->parameters()));
  }
  EXPECT_EQ(guard.checkpoints_written(), (steps - 1) / 3);  // the last one waits for a next step
  return after;
}

TEST(GuardResume, ContinuesBitwiseFromTheNewestValidCheckpoint) {
  const std::string dir = fresh_dir("resume");
  const auto reference = train_with_checkpoints(dir, 11);  // checkpoints 3, 6, 9 visible
  ASSERT_EQ(list_checkpoints(dir).back().step, 9);

  auto model = make_model(99);  // other weights: resume must overwrite them
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(opt, GuardOptions().checkpoint_dir(dir).checkpoint_every(3));
  ASSERT_EQ(guard.resume(dir), 9);
  EXPECT_EQ(guard.step_count(), 9);
  EXPECT_EQ(guard.data_position(), 9);
  EXPECT_EQ(guard.totals().applied, 9);
  for (std::size_t i = 0; i < reference[8].size(); ++i) {
    EXPECT_TRUE(bitwise_equal(model->parameters()[i], reference[8][i])) << i;
  }
  for (std::int64_t step = 10; step <= 11; ++step) {
    opt.zero_grad();
    auto loss = loss_of(model, step);
    loss.backward();
    EXPECT_EQ(guard.step(loss).step, step);
    for (std::size_t i = 0; i < reference[0].size(); ++i) {
      EXPECT_TRUE(
          bitwise_equal(model->parameters()[i], reference[static_cast<std::size_t>(step - 1)][i]))
          << "step " << step;
    }
  }
}

TEST(GuardResume, ACorruptNewestCheckpointFallsBackToThePreviousOne) {
  const std::string dir = fresh_dir("fallback");
  const auto reference = train_with_checkpoints(dir, 11);
  fs::resize_file(step_dir(dir, 9) + "/rank-00000.ckpt", 10);
  auto model = make_model(99);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(opt);
  ASSERT_EQ(guard.resume(dir), 6);
  for (std::size_t i = 0; i < reference[5].size(); ++i) {
    EXPECT_TRUE(bitwise_equal(model->parameters()[i], reference[5][i])) << i;
  }
}

TEST(GuardResume, NothingValidChangesNothing) {
  const std::string dir = fresh_dir("none");
  auto model = make_model(5);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(opt);
  const auto before = clone_all(model->parameters());
  EXPECT_EQ(guard.resume(dir), 0);
  EXPECT_EQ(guard.resume("/nonexistent/stepguard"), 0);
  // A checkpoint of another model does not fit: refused, nothing changes.
  const std::string other = fresh_dir("other");
  {
    auto small = torch::nn::Linear(3, 2);
    torch::optim::SGD sgd(small->parameters(), torch::optim::SGDOptions(0.1));
    GuardedOptimizer g(sgd, GuardOptions().checkpoint_dir(other).checkpoint_every(1));
    for (int i = 0; i < 2; ++i) {
      sgd.zero_grad();
      auto loss = small->forward(torch::ones({1, 3})).sum();
      loss.backward();
      g.step(loss);
    }
  }
  EXPECT_EQ(guard.resume(other), 0);
  EXPECT_EQ(guard.step_count(), 0);
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(model->parameters()[i], before[i]));
  }
}

TEST(GuardResume, ACheckpointIsDiscardedWhenTheNextStepIsBad) {
  const std::string dir = fresh_dir("discard");
  auto model = make_model(6);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(opt, GuardOptions().checkpoint_dir(dir).checkpoint_every(2));
  for (std::int64_t step = 1; step <= 3; ++step) {
    opt.zero_grad();
    auto loss = loss_of(model, step);
    if (step == 3) loss = loss * std::numeric_limits<double>::quiet_NaN();
    loss.backward();
    guard.step(loss);
  }
  EXPECT_TRUE(list_checkpoints(dir).empty());  // step 2's state is the suspect
  EXPECT_FALSE(fs::exists(step_dir(dir, 2)));
  EXPECT_EQ(guard.checkpoints_written(), 0);
}

TEST(GuardResume, CheckpointDirWithoutCadenceIsRefused) {
  auto model = make_model(7);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_THROW(GuardedOptimizer(opt, GuardOptions().checkpoint_dir("/tmp/x")), c10::Error);
  EXPECT_THROW(GuardedOptimizer(opt, GuardOptions().checkpoint_every(5)), c10::Error);
}

}  // namespace
}  // namespace stepguard
