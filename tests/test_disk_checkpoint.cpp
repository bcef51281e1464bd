// The guard resumes bitwise from disk checkpoints. The checkpoint files themselves (atomic writes,
// damage detection, crash torture) are tested in test_disk_checkpoint_files.cpp.
#include <gtest/gtest.h>
#include <stepguard/stepguard.h>
#include <torch/torch.h>

#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "csrc/checkpoint/disk_checkpoint.h"
#include "csrc/checkpoint/payload.h"
#include "tests/support/fresh_dir.h"
#include "tests/support/model_fixture.h"

namespace stepguard {
namespace {

namespace fs = std::filesystem;
using namespace checkpoint;

// Trains `steps` steps through a guard that checkpoints every 3 steps into `dir`; returns the
// parameters after every step. Each step's background write is waited for before the next step,
// so every checkpoint is committed at the step after it, however fast the disk is.
std::vector<std::vector<torch::Tensor>> train_with_checkpoints(const std::string& dir,
                                                               std::int64_t steps,
                                                               const std::string& run_id = "") {
  auto model = make_model(21);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(opt,
                         GuardOptions().checkpoint_dir(dir).checkpoint_every(3).run_id(run_id));
  std::vector<std::vector<torch::Tensor>> after;
  for (std::int64_t step = 1; step <= steps; ++step) {
    opt.zero_grad();
    auto loss = loss_of(model, step);
    loss.backward();
    EXPECT_TRUE(guard.step(loss).applied());
    guard.wait_for_background_work();
    after.push_back(clone_all(model->parameters()));
  }
  EXPECT_EQ(guard.stats().checkpoints_written,
            (steps - 1) / 3);  // the last one waits for a next step
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
  EXPECT_EQ(guard.stats().step_count, 9);
  EXPECT_EQ(guard.stats().data_position, 9);
  EXPECT_EQ(guard.stats().totals.applied, 9);
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

// An lr lowered during training (as a schedule does) comes back with the checkpoint, as the
// optimizer's own archive would bring it; the fresh optimizer's lr does not win.
TEST(GuardResume, PutsBackEachParamGroupsLearningRate) {
  const std::string dir = fresh_dir("resume_lr");
  auto model = make_model(21);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  opt.param_groups()[0].options().set_lr(0.025);
  {
    GuardedOptimizer guard(opt, GuardOptions().checkpoint_dir(dir).checkpoint_every(1));
    for (std::int64_t step = 1; step <= 2; ++step) {
      opt.zero_grad();
      auto loss = loss_of(model, step);
      loss.backward();
      ASSERT_TRUE(guard.step(loss).applied());
      guard.wait_for_background_work();
    }
  }
  auto other = make_model(99);
  torch::optim::SGD fresh(other->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  GuardedOptimizer resumed(fresh, GuardOptions());
  ASSERT_EQ(resumed.resume(dir), 1);
  EXPECT_EQ(fresh.param_groups()[0].options().get_lr(), 0.025);
  auto& sgd = static_cast<torch::optim::SGDOptions&>(fresh.param_groups()[0].options());
  EXPECT_EQ(sgd.momentum(), 0.9);
}

// A new run in a directory that holds another run's checkpoints is refused at its first step
// (nothing written, nothing pruned); resuming from it continues that run, whose checkpoints
// then prune as before.
TEST(GuardResume, ADirectoryOfAnotherRunIsRefusedUnlessResumedFrom) {
  const std::string dir = fresh_dir("other_run");
  train_with_checkpoints(dir, 11);  // run id drawn at its first step; 3, 6, 9 visible
  ASSERT_EQ(runs_under(dir).size(), 1u);
  const std::string old_run = runs_under(dir)[0];
  EXPECT_EQ(old_run.size(), 13u) << old_run;
  for (const std::string& given : {std::string(), std::string("fresh-run")}) {
    auto model = make_model(99);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    GuardedOptimizer guard(opt,
                           GuardOptions().checkpoint_dir(dir).checkpoint_every(3).run_id(given));
    opt.zero_grad();
    auto loss = loss_of(model, 1);
    loss.backward();
    try {
      guard.step(loss);
      FAIL() << "a directory of another run was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(e.msg().find("checkpoint_dir " + dir + " holds checkpoints of another run ('" +
                             old_run + "'"),
                std::string::npos)
          << e.msg();
    }
  }
  EXPECT_EQ(list_checkpoints(dir).size(), 3u);
  // The same run (resumed) goes on writing and pruning its own checkpoints.
  auto model = make_model(99);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(opt, GuardOptions().checkpoint_dir(dir).checkpoint_every(3));
  ASSERT_EQ(guard.resume(dir), 9);
  for (std::int64_t step = 10; step <= 16; ++step) {
    opt.zero_grad();
    auto loss = loss_of(model, step);
    loss.backward();
    ASSERT_TRUE(guard.step(loss).applied());
    guard.wait_for_background_work();  // each write done before the next step: no checkpoint is
                                       // skipped
  }
  std::vector<std::int64_t> steps;
  for (const auto& e : list_checkpoints(dir)) {
    steps.push_back(e.step);
    EXPECT_EQ(e.run, old_run);
  }
  EXPECT_EQ(steps, (std::vector<std::int64_t>{9, 12, 15}));
  EXPECT_THROW(GuardedOptimizer(opt, GuardOptions().run_id("no spaces")), c10::Error);
}

// The same run id restarted without resuming (resume() refused the checkpoints: another
// optimizer, another model; or was never called): its first step is refused and the run's
// checkpoints stay. Starting would have pruned all of them at the first commit.
TEST(GuardResume, ARunThatDidNotResumeItsOwnCheckpointsDeletesNone) {
  const std::string dir = fresh_dir("refused_own");
  train_with_checkpoints(dir, 11, "exp1");  // 3, 6, 9 visible
  ASSERT_EQ(list_checkpoints(dir).size(), 3u);
  for (const bool resume_refused : {true, false}) {
    auto model = make_model(99);
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(1e-2));
    // Another optimizer type than the checkpoints' (AdamW): resume() refuses all three.
    torch::optim::Optimizer& opt =
        resume_refused ? static_cast<torch::optim::Optimizer&>(sgd) : adamw;
    GuardOptions options = GuardOptions().checkpoint_dir(dir).checkpoint_every(3).run_id("exp1");
    GuardedOptimizer guard(opt, options);
    if (resume_refused) {
      ASSERT_EQ(guard.resume(dir), 0);
    }
    opt.zero_grad();
    auto loss = loss_of(model, 1);
    loss.backward();
    try {
      guard.step(loss);
      ADD_FAILURE() << "a run that did not resume its own checkpoints was started";
    } catch (const c10::Error& e) {
      EXPECT_NE(e.msg().find("holds checkpoints of this run ('exp1') that it did not resume from"),
                std::string::npos)
          << e.msg();
      EXPECT_EQ(e.msg().find("run_id"), std::string::npos) << "no way on into the deletion";
    }
    std::vector<std::int64_t> steps;
    for (const auto& c : list_checkpoints(dir)) steps.push_back(c.step);
    EXPECT_EQ(steps, (std::vector<std::int64_t>{3, 6, 9}));
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
  EXPECT_EQ(guard.stats().step_count, 0);
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(model->parameters()[i], before[i]));
  }
}

// A checkpoint whose optimizer state has another shape than the live optimizer's, with valid
// checksums: refused before anything changes, naming the tensor (it used to load, and the first
// step failed with a raw torch error).
TEST(GuardResume, AWrongOptimizerStateShapeIsRefusedBeforeAnythingChanges) {
  const std::string dir = fresh_dir("state_src");
  train_with_checkpoints(dir, 11);  // checkpoints 3, 6, 9
  DecodedPayload p = decode_payload(read_rank_file(list_checkpoints(dir).back(), 0), "test");
  std::string reshaped;
  for (auto& t : p.tensors) {
    if (reshaped.empty() && t.name.rfind("optimizer.", 0) == 0 && t.tensor.numel() > 1) {
      t.tensor = torch::zeros({t.tensor.numel() + 1}, t.tensor.options());
      reshaped = t.name;
    }
  }
  ASSERT_FALSE(reshaped.empty());
  const std::string bad = fresh_dir("state_bad");
  const EncodedPayload encoded = encode_payload(p.record, p.tensors, p.opaque, p.rng);
  write_rank_file(bad, "tampered", 9, 0, encoded.pieces());
  commit_checkpoint(bad, "tampered", 9, 1, 3);
  ASSERT_TRUE(verify_checkpoint(list_checkpoints(bad).at(0)).ok());  // checksums are fine

  auto model = make_model(99);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(opt);
  const auto before = clone_all(model->parameters());
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(guard.resume(bad), 0);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("cannot resume from " + step_dir(bad, 9)), std::string::npos) << err;
  EXPECT_NE(err.find(reshaped.substr(std::string("optimizer.").size())), std::string::npos) << err;
  EXPECT_EQ(guard.stats().step_count, 0);
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(model->parameters()[i], before[i])) << i;
  }
  opt.zero_grad();
  auto loss = loss_of(model, 1);
  loss.backward();
  EXPECT_TRUE(guard.step(loss).applied());  // training goes on from scratch, no raw error
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
  EXPECT_EQ(guard.stats().checkpoints_written, 0);
}

TEST(GuardResume, CheckpointDirWithoutCadenceIsRefused) {
  auto model = make_model(7);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_THROW(GuardedOptimizer(opt, GuardOptions().checkpoint_dir("/tmp/x")), c10::Error);
  EXPECT_THROW(GuardedOptimizer(opt, GuardOptions().checkpoint_every(5)), c10::Error);
}

}  // namespace
}  // namespace stepguard
