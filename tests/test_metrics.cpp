// Metrics move as the guard acts, and a real HTTP scrape sees them.
#include <gtest/gtest.h>
#include <stepguard/stepguard.h>
#include <torch/torch.h>

#include <filesystem>
#include <limits>
#include <map>
#include <sstream>

#include "csrc/checkpoint/disk_checkpoint.h"
#include "plugin/src/recovery.h"
#include "tests/support/fresh_dir.h"
#include "tests/support/gate.h"
#include "tests/support/http_get.h"

namespace stepguard {
namespace {

// The value of the series `name` whose labels include every pair of `labels`; NaN when absent.
double value_of(const std::string& text, const std::string& name,
                const std::map<std::string, std::string>& labels = {}) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name + "{", 0) != 0 && line.rfind(name + " ", 0) != 0) continue;
    bool match = true;
    for (const auto& [k, v] : labels) {
      if (line.find(k + "=\"" + v + "\"") == std::string::npos) match = false;
    }
    if (match) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return std::numeric_limits<double>::quiet_NaN();
}

#if defined(STEPGUARD_EXPECT_METRICS) && STEPGUARD_EXPECT_METRICS

TEST(Metrics, CountersAndGaugesFollowTheGuard) {
  auto p = torch::zeros({4}, torch::requires_grad());
  torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(
      sgd, GuardOptions().metrics_port(0).metrics_run_label("unit").max_consecutive_bad_steps(2));
  ASSERT_FALSE(guard.stats().metrics_endpoint.empty());
  std::string text = guard.metrics_text();
  // Every series exists at zero before the first step.
  EXPECT_EQ(value_of(text, "stepguard_steps_total", {{"outcome", "skipped"}, {"run", "unit"}}), 0);
  EXPECT_EQ(value_of(text, "stepguard_actions_total", {{"action", "rollback"}}), 0);
  EXPECT_EQ(value_of(text, "stepguard_incidents_total", {{"signal", "rank_desync"}}), 0);
  EXPECT_EQ(value_of(text, "stepguard_lr_factor"), 1);
  EXPECT_EQ(value_of(text, "stepguard_build_info", {{"version", version()}}), 1);

  auto step = [&](bool bad) {
    sgd.zero_grad();
    auto loss = (p - 1.0).pow(2).sum();
    loss.backward();
    if (bad) p.mutable_grad()[0] = std::numeric_limits<float>::quiet_NaN();
    return guard.step(loss);
  };
  step(false);
  step(false);
  step(true);
  text = guard.metrics_text();
  EXPECT_EQ(value_of(text, "stepguard_steps_total", {{"outcome", "applied"}}), 2);
  EXPECT_EQ(value_of(text, "stepguard_steps_total", {{"outcome", "skipped"}}), 1);
  EXPECT_EQ(value_of(text, "stepguard_nonfinite_steps_total"), 1);
  EXPECT_EQ(value_of(text, "stepguard_skipped_batches_total"), 1);
  EXPECT_EQ(value_of(text, "stepguard_actions_total", {{"action", "skip_batch"}}), 1);
  EXPECT_EQ(value_of(text, "stepguard_actions_total", {{"action", "apply"}}), 2);
  EXPECT_EQ(value_of(text, "stepguard_incidents_total", {{"signal", "nonfinite_grad"}}), 1);
  EXPECT_EQ(value_of(text, "stepguard_last_step"), 3);
  EXPECT_EQ(value_of(text, "stepguard_last_applied_step"), 2);
  EXPECT_GT(value_of(text, "stepguard_last_applied_timestamp_seconds"), 1.7e9);
  EXPECT_EQ(value_of(text, "stepguard_consecutive_bad_steps"), 1);
  EXPECT_EQ(value_of(text, "stepguard_inspect_duration_seconds_count"), 3);
  EXPECT_EQ(value_of(text, "stepguard_consensus_duration_seconds_count"), 3);
  EXPECT_EQ(value_of(text, "stepguard_aborted"), 0);
  // Loss of the last (skipped) step: SGD with lr 0.1 took p from 0 to 0.2 to 0.36, and the loss
  // is 4 * (0.36 - 1)^2.
  EXPECT_NEAR(value_of(text, "stepguard_loss"), 4 * 0.64 * 0.64, 1e-6);

  step(true);  // second bad step in a row: the limit of 2 aborts
  text = guard.metrics_text();
  EXPECT_EQ(value_of(text, "stepguard_aborted"), 1);
  EXPECT_EQ(value_of(text, "stepguard_aborts_total"), 1);
  EXPECT_EQ(value_of(text, "stepguard_steps_total", {{"outcome", "aborted"}}), 1);

  // A real scrape over HTTP sees the same.
  const std::string endpoint = guard.stats().metrics_endpoint;
  const int port = std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
  EXPECT_EQ(endpoint, "http://127.0.0.1:" + std::to_string(port) + "/metrics");  // a URL
  int status = 0;
  const std::string scraped = testing_support::http_get("127.0.0.1", port, "/metrics", &status);
  EXPECT_EQ(status, 200);
  EXPECT_EQ(value_of(scraped, "stepguard_aborts_total"), 1);
  testing_support::http_get("127.0.0.1", port, "/other", &status);
  EXPECT_EQ(status, 404);
}

TEST(Metrics, SnapshotsAndCheckpointsAreCounted) {
  const std::string dir = ::testing::TempDir() + "/sg_metrics_ckpt";
  std::filesystem::remove_all(dir);
  auto p = torch::zeros({4}, torch::requires_grad());
  torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(sgd, GuardOptions()
                                  .metrics_port(0)
                                  .policy_yaml("version: 1\ncheckpoint: {snapshot_every: 1, "
                                               "snapshot_keep: 2}\n")
                                  .checkpoint_dir(dir)
                                  .checkpoint_every(2));
  EXPECT_EQ(value_of(guard.metrics_text(), "stepguard_checkpoints_total"), 0);
  for (int i = 0; i < 5; ++i) {
    sgd.zero_grad();
    auto loss = (p - 1.0).pow(2).sum();
    loss.backward();
    guard.step(loss);
    guard.wait_for_background_work();  // the copy and the write are done before the next step, at
                                       // any speed
  }
  const std::string text = guard.metrics_text();
  EXPECT_EQ(value_of(text, "stepguard_snapshots_total"), 5);
  // Two copies of 4 floats and of the optimizer's record (its group's lr: T{"lr":[0.1],...}).
  const std::string record = R"(T{"lr":[0.1],"states":[]})";
  EXPECT_EQ(value_of(text, "stepguard_snapshot_bytes"), 2 * (4 * 4 + record.size()));
  EXPECT_EQ(value_of(text, "stepguard_checkpoints_total"), 2);  // steps 2 and 4
  EXPECT_EQ(value_of(text, "stepguard_last_checkpoint_step"), 4);
  EXPECT_EQ(value_of(text, "stepguard_checkpoint_write_duration_seconds_count"), 2);
  EXPECT_EQ(value_of(text, "stepguard_checkpoint_interval_steps"), 2);
  EXPECT_EQ(value_of(text, "stepguard_checkpoint_failures_total"), 0);
  EXPECT_EQ(value_of(text, "stepguard_checkpoints_skipped_total"), 0);
  std::filesystem::remove_all(dir);
}

// A checkpoint that cannot be written (here: a directory nobody can create, even root) is
// logged and counted; training goes on. The write fails in the background: the test waits for
// it (synchronize), not for time to pass.
TEST(Metrics, ACheckpointThatCannotBeWrittenIsCountedAndTrainingGoesOn) {
  auto p = torch::zeros({4}, torch::requires_grad());
  torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(
      sgd, GuardOptions().metrics_port(0).checkpoint_dir("/proc/stepguard-no").checkpoint_every(2));
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 5; ++i) {
    sgd.zero_grad();
    auto loss = (p - 1.0).pow(2).sum();
    loss.backward();
    EXPECT_TRUE(guard.step(loss).applied()) << i;
    guard.wait_for_background_work();
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("step 2: writing the disk checkpoint failed (/proc/stepguard-no/"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("training goes on"), std::string::npos) << err;
  const std::string text = guard.metrics_text();
  EXPECT_EQ(value_of(text, "stepguard_checkpoint_failures_total"), 2);  // steps 2 and 4
  EXPECT_EQ(value_of(text, "stepguard_checkpoints_total"), 0);
  EXPECT_EQ(guard.stats().checkpoints_written, 0);
}

// Steps through a guard that checkpoints every 2 steps into `dir`, waiting for the background work
// of each step when `sync`.
struct CheckpointingRun {
  explicit CheckpointingRun(const std::string& dir)
      : p(torch::zeros({4}, torch::requires_grad())),
        sgd({p}, torch::optim::SGDOptions(0.1)),
        guard(sgd, GuardOptions().metrics_port(0).checkpoint_dir(dir).checkpoint_every(2)) {}
  StepReport step() {
    sgd.zero_grad();
    auto loss = (p - 1.0).pow(2).sum();
    loss.backward();
    return guard.step(loss);
  }
  torch::Tensor p;
  torch::optim::SGD sgd;
  GuardedOptimizer guard;
};

// A write that fails in the background (held at a gate, then failing as an allocation of its
// host copy would): counted and logged, training goes on, the last good checkpoint stays.
TEST(Metrics, ABackgroundWriteErrorIsCountedAndTheLastGoodCheckpointStays) {
  const std::string dir = fresh_dir("background_error");
  CheckpointingRun run(dir);
  for (int i = 1; i <= 3; ++i) {  // step 2's checkpoint is written, step 3 commits it
    EXPECT_TRUE(run.step().applied());
    run.guard.wait_for_background_work();
  }
  ASSERT_EQ(run.guard.stats().checkpoints_written, 1);
  ::testing::internal::CaptureStderr();
  {
    Gate gate(&Recovery::set_write_hook_for_testing);
    EXPECT_TRUE(run.step().applied());  // step 4: its write starts and waits at the gate
    EXPECT_EQ(gate.held(), 4);
    EXPECT_EQ(value_of(run.guard.metrics_text(), "stepguard_checkpoint_failures_total"), 0);
    gate.open(/*fail=*/true);
    run.guard.wait_for_background_work();  // the failure is in now
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("step 4: writing the disk checkpoint failed (std::bad_alloc)"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("training goes on, the last good checkpoint stays"), std::string::npos);
  EXPECT_EQ(value_of(run.guard.metrics_text(), "stepguard_checkpoint_failures_total"), 1);
  for (int i = 5; i <= 7; ++i) {  // step 6's checkpoint is written, step 7 commits it
    EXPECT_TRUE(run.step().applied());
    run.guard.wait_for_background_work();
  }
  EXPECT_EQ(run.guard.stats().checkpoints_written, 2);
  std::vector<std::int64_t> steps;
  for (const auto& e : checkpoint::list_checkpoints(dir)) steps.push_back(e.step);
  EXPECT_EQ(steps, (std::vector<std::int64_t>{2, 6}));  // step 4's never became visible
  EXPECT_EQ(value_of(run.guard.metrics_text(), "stepguard_checkpoint_failures_total"), 1);
}

// One checkpoint in flight: one due while the last is still being written is skipped, logged
// and counted, and the one being written becomes visible once done.
TEST(Metrics, ACheckpointDueWhileOneIsWritingIsSkippedAndCounted) {
  const std::string dir = fresh_dir("skipped");
  CheckpointingRun run(dir);
  ::testing::internal::CaptureStderr();
  {
    Gate gate(&Recovery::set_write_hook_for_testing);
    EXPECT_TRUE(run.step().applied());
    EXPECT_TRUE(run.step().applied());  // step 2's write waits at the gate
    EXPECT_EQ(gate.held(), 2);
    EXPECT_TRUE(run.step().applied());
    EXPECT_TRUE(run.step().applied());  // step 4's is due while step 2's is being written
    EXPECT_EQ(gate.passed(), 0);
    EXPECT_EQ(run.guard.stats().checkpoints_written, 0);
    gate.open();
    run.guard.wait_for_background_work();
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("step 4: disk checkpoint skipped: the one of step 2 is still being written"),
            std::string::npos)
      << err;
  const std::string text = run.guard.metrics_text();
  EXPECT_EQ(value_of(text, "stepguard_checkpoints_skipped_total"), 1);
  EXPECT_EQ(value_of(text, "stepguard_checkpoint_failures_total"), 0);
  EXPECT_TRUE(run.step().applied());  // step 5: every rank has written step 2's; it is clean
  EXPECT_EQ(run.guard.stats().checkpoints_written, 1);
  ASSERT_EQ(checkpoint::list_checkpoints(dir).size(), 1u);
  EXPECT_EQ(checkpoint::list_checkpoints(dir)[0].step, 2);
  run.guard.wait_for_background_work();
  EXPECT_TRUE(run.step().applied());  // step 6: written again
  run.guard.wait_for_background_work();
  run.guard.commit_pending_checkpoint();
  EXPECT_EQ(checkpoint::list_checkpoints(dir).back().step, 6);
  EXPECT_EQ(value_of(run.guard.metrics_text(), "stepguard_checkpoints_skipped_total"), 1);
}

TEST(Metrics, NoLabelNamesAStepOrBatch) {
  auto p = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(sgd, GuardOptions().metrics_port(0));
  const std::string text = guard.metrics_text();
  EXPECT_EQ(text.find("step=\""), std::string::npos);
  EXPECT_EQ(text.find("batch=\""), std::string::npos);
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    EXPECT_EQ(line.rfind("stepguard_", 0), 0u) << line;
  }
}

TEST(Metrics, ABusyPortOrBadAddressIsAClearError) {
  auto p = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1));
  GuardedOptimizer first(sgd, GuardOptions().metrics_port(0));
  const std::string endpoint = first.stats().metrics_endpoint;
  const int port = std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
  try {
    GuardedOptimizer second(sgd, GuardOptions().metrics_port(port));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("cannot serve metrics on 127.0.0.1:" + std::to_string(port)),
              std::string::npos)
        << e.msg();
  }
  EXPECT_THROW(GuardedOptimizer(sgd, GuardOptions().metrics_port(0).metrics_bind_address("nohost")),
               c10::Error);
  EXPECT_THROW(GuardedOptimizer(sgd, GuardOptions().metrics_port(70000)), c10::Error);
}

#endif

TEST(Metrics, OffByDefault) {
  auto p = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(sgd);
  EXPECT_TRUE(guard.stats().metrics_endpoint.empty());
  EXPECT_TRUE(guard.metrics_text().empty());
}

}  // namespace
}  // namespace stepguard
