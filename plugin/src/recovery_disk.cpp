// Recovery's disk checkpoints: claiming the directory for this run, writing each rank's file in
// the background, and committing (or discarding) it once the step after it has judged it. The
// RAM snapshots, restores and resume are in recovery.cpp.
#include <unistd.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>

#include "csrc/checkpoint/dir_lock.h"
#include "csrc/checkpoint/disk_checkpoint.h"
#include "plugin/src/recovery.h"

namespace stepguard {

namespace {

// Run ids travel through gather_values as exact doubles: at most 52 bits.
constexpr std::int64_t kRunBits = (std::int64_t{1} << 52) - 1;

std::string run_hex(std::int64_t v) {
  char hex[16];
  std::snprintf(hex, sizeof hex, "%013" PRIx64, static_cast<std::uint64_t>(v));
  return hex;
}

bool same_dir(const std::string& a, const std::string& b) {
  std::error_code ea, eb;
  const auto ca = std::filesystem::weakly_canonical(a, ea);
  const auto cb = std::filesystem::weakly_canonical(b, eb);
  return (ea || eb) ? a == b : ca == cb;
}

checkpoint::TestHook write_hook;

}  // namespace

void Recovery::set_write_hook_for_testing(std::function<void(std::int64_t)> hook) {
  write_hook.set(std::move(hook));
}

void Recovery::claim_checkpoint_dir(std::int64_t step) {
  if (claimed_ || config_.disk_every <= 0) return;
  claimed_ = true;
  // A run id given or adopted by resume() is checked for equality across ranks; otherwise
  // rank 0's random one is everyone's.
  const bool chosen = !run_.empty() || !config_.run_id.empty();
  if (run_.empty()) run_ = config_.run_id;
  std::string refusal;
  if (consensus_.rank() == 0) {
    // From now on the directory is this run's while it lives: a second run started on it is
    // refused here, before either has written a checkpoint.
    std::string holder;
    try {
      dir_lock_ = checkpoint::lock_checkpoint_dir(config_.checkpoint_dir, &holder);
    } catch (const checkpoint::CheckpointError& e) {
      // A directory that cannot be made or opened is no other run's: its writes will fail,
      // be logged and counted, and training goes on, as for any checkpoint that cannot be written.
      std::fprintf(stderr, "stepguard: cannot lock checkpoint_dir: %s\n", e.what());
    }
    if (dir_lock_ < 0 && !holder.empty()) {
      refusal = "stepguard: checkpoint_dir " + config_.checkpoint_dir +
                " is in use by another live run (" + holder +
                "): give each run its own directory. Nothing was written.";
    }
  }
  if (refusal.empty() &&
      (resumed_from_.empty() || !same_dir(config_.checkpoint_dir, resumed_from_))) {
    // Checkpoints this process did not restore from are never pruned by it, its own run id's
    // included (a resume that refused them, or none called): starting would delete them.
    for (const std::string& other : checkpoint::runs_under(config_.checkpoint_dir)) {
      const bool same_run = chosen && other == run_;
      refusal = "stepguard: checkpoint_dir " + config_.checkpoint_dir + " holds checkpoints of " +
                (same_run ? "this run ('" + run_ + "') that it did not resume from"
                          : "another run ('" + (other.empty() ? "unnamed" : other) + "'") +
                (same_run ? " (resume() refused them or was not called; see `stepguard ckpt ls`)"
                          : "; see `stepguard ckpt ls`)") +
                ": resume from them (resume() / --resume), or start this run in another "
                "directory. Nothing was written, nothing was deleted.";
      break;
    }
  }
  std::int64_t mine = 0;
  if (chosen) {
    mine = static_cast<std::int64_t>(std::hash<std::string>{}(run_)&kRunBits);
  } else {
    std::random_device device_entropy;  // never the training RNG: runs stay reproducible
    mine = ((static_cast<std::int64_t>(device_entropy()) << 32) ^ device_entropy()) & kRunBits;
  }
  const auto all =
      consensus::gather_values(consensus_, refusal.empty() ? mine : -1, step, device());
  TORCH_CHECK(refusal.empty(), refusal);
  for (std::size_t r = 0; r < all.size(); ++r) {
    TORCH_CHECK(all[r] >= 0, "stepguard: rank ", r, " refused checkpoint_dir ",
                config_.checkpoint_dir,
                " (another run's checkpoints are there, or another live run uses it; see rank ", r,
                "'s error)");
    TORCH_CHECK(!chosen || all[r] == all[0], "stepguard: the ranks were given different run ids ",
                "(rank 0 and rank ", r, " differ); give every rank the same run_id");
  }
  if (!chosen) run_ = run_hex(all[0]);
}

bool Recovery::disk_due(std::int64_t step, bool applied) const noexcept {
  return config_.disk_every > 0 && applied && step % config_.disk_every == 0;
}

checkpoint::BackgroundThread& Recovery::writer() {
  if (!writer_) writer_ = std::make_unique<checkpoint::BackgroundThread>("sg-ckpt-writer");
  return *writer_;
}

bool Recovery::write_checkpoint(const checkpoint::GuardRecord& record) {
  if (pending_step_ != 0) {
    // One checkpoint in flight: host memory stays bounded and the ranks settle one at a time.
    count({CheckpointEvent::Kind::kSkipped});
    std::fprintf(stderr,
                 "stepguard: rank %d: step %" PRId64
                 ": disk checkpoint skipped: the one of step %" PRId64
                 " is still being written (the disk is slower than the checkpoint cadence)\n",
                 consensus_.rank(), record.step, pending_step_);
    return false;
  }
  pending_step_ = record.step;  // settled at a later step either way
  pending_verdict_ = Verdict::kOpen;
  pending_failed_ = false;
  pending_seen_ = false;
  pending_seconds_ = 0.0;
  try {
    // The RAM snapshot of this step when there is one; else a host copy of its own, made on the
    // writer thread before the write (the training thread waits for it, not for the write).
    checkpoint::SnapshotCopy copy =
        ring_ ? ring_->copy_of(record.step) : checkpoint::SnapshotCopy();
    if (!copy.valid()) {
      std::shared_ptr<const checkpoint::Snapshot> reuse = std::move(disk_spare_);
      if (reuse && reuse.use_count() != 1) reuse.reset();   // still held: never refilled
      std::atomic_thread_fence(std::memory_order_acquire);  // pairs with the holder's release
      disk_copy_ = checkpoint::start_copy(writer(), record.step, frozen_tensors(),
                                          port_.state_bytes(), {}, reuse, /*checksum=*/false);
      copy = disk_copy_;
      pending_copy_ = disk_copy_;
    }
    auto timer = std::make_shared<double>(0.0);
    pending_timer_ = timer;
    pending_write_ = writer().submit([copy, record, timer, dir = config_.checkpoint_dir, run = run_,
                                      rank = consensus_.rank()]() mutable {
      using Clock = std::chrono::steady_clock;
      // The job lets go of the copy before its future is ready: by then only the training
      // thread holds it (so its buffers can be refilled).
      struct Release {
        checkpoint::SnapshotCopy& copy;
        ~Release() { copy = checkpoint::SnapshotCopy(); }
      } release{copy};
      write_hook.run(record.step);
      const auto start = Clock::now();
      const std::shared_ptr<const checkpoint::Snapshot> s = copy.get();
      const checkpoint::EncodedPayload payload =
          checkpoint::encode_payload(record, s->tensors, s->opaque, s->rng);
      checkpoint::write_rank_file(dir, run, record.step, rank, payload.pieces());
      *timer = std::chrono::duration<double>(Clock::now() - start).count();
    });
  } catch (const std::exception& e) {
    // Nothing started (the opaque state could not be taken, no thread): a failed write.
    pending_write_ = std::future<void>();
    pending_seen_ = true;
    write_failed(e.what());
  }
  return true;
}

void Recovery::write_failed(const char* why) {
  pending_failed_ = true;
  count({CheckpointEvent::Kind::kFailed});
  std::fprintf(stderr,
               "stepguard: rank %d: step %" PRId64
               ": writing the disk checkpoint failed (%s); training goes on, the last good "
               "checkpoint stays\n",
               consensus_.rank(), pending_step_, why);
}

void Recovery::observe_write(bool wait) {
  if (pending_step_ == 0 || pending_seen_) return;
  if (!wait && pending_write_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    return;
  }
  pending_seen_ = true;
  try {
    pending_write_.get();
    pending_seconds_ = *pending_timer_;
  } catch (const std::exception& e) {
    write_failed(e.what());
  }
}

bool Recovery::checkpoint_written() {
  observe_write(false);
  return pending_step_ == 0 || pending_seen_;
}

void Recovery::wait_for_checkpoint() { observe_write(true); }

void Recovery::remove_later(std::vector<std::string> hidden) noexcept {
  if (hidden.empty()) return;
  try {
    // Behind the writes on the writer thread: the next commit comes after it.
    (void)writer().submit([hidden] { checkpoint::remove_hidden(hidden); });
  } catch (const std::exception&) {
    checkpoint::remove_hidden(hidden);
  }
}

bool Recovery::commit(std::int64_t step) {
  std::vector<std::string> hidden;  // pruned checkpoints, out of sight, deleted in the background
  try {
    checkpoint::commit_checkpoint(config_.checkpoint_dir, run_, step, consensus_.world_size(),
                                  config_.disk_keep, &hidden);
    remove_later(std::move(hidden));
    return true;
  } catch (const std::exception& e) {
    remove_later(std::move(hidden));
    count({CheckpointEvent::Kind::kFailed});
    std::fprintf(stderr,
                 "stepguard: step %" PRId64
                 ": committing the disk checkpoint failed (%s); it is discarded, the last good "
                 "checkpoint stays\n",
                 step, e.what());
    discard(step);
    return false;
  }
}

void Recovery::discard(std::int64_t step) noexcept {
  std::vector<std::string> hidden;
  try {
    checkpoint::discard_checkpoint(config_.checkpoint_dir, run_, step, &hidden);
    remove_later(std::move(hidden));
  } catch (const std::exception& e) {
    remove_later(std::move(hidden));
    // What is left is pending and never loaded; the next commit clears it.
    std::fprintf(stderr, "stepguard: step %" PRId64 ": removing a pending checkpoint failed (%s)\n",
                 step, e.what());
  }
}

std::int64_t Recovery::finish_pending(bool keep) {
  const std::int64_t pending = pending_step_;
  pending_step_ = 0;
  pending_write_ = std::future<void>();
  pending_timer_.reset();
  if (pending_copy_.valid()) {
    // Written: its buffers serve the next checkpoint that needs a copy of its own.
    if (!pending_failed_ && pending_copy_.finished()) {
      try {
        disk_spare_ = pending_copy_.get();
      } catch (const std::exception&) {
      }
    }
    pending_copy_ = checkpoint::SnapshotCopy();
  }
  // Rank 0 writes the manifest: every rank's write has finished (agreed by a collective).
  if (consensus_.rank() == 0) {
    if (keep && pending_failed_) {
      keep = false;  // counted when the write failed
      discard(pending);
    } else if (keep) {
      keep = commit(pending);
    } else {
      discard(pending);
    }
  }
  if (!keep) return 0;
  count({CheckpointEvent::Kind::kWritten, pending, pending_seconds_});
  return pending;
}

void Recovery::count(CheckpointEvent event) {
  switch (event.kind) {
    case CheckpointEvent::Kind::kWritten:
      ++counts_.written;
      break;
    case CheckpointEvent::Kind::kFailed:
      ++counts_.failed;
      break;
    case CheckpointEvent::Kind::kSkipped:
      ++counts_.skipped;
      break;
  }
  if (observer_) observer_(event);
}

std::int64_t Recovery::settle_pending(std::int64_t step, bool clean, bool all_written) {
  if (pending_step_ == 0) return 0;
  if (pending_verdict_ == Verdict::kOpen) {
    pending_verdict_ = pending_step_ == step - 1 && clean ? Verdict::kKeep : Verdict::kDrop;
  }
  // Until every rank has finished writing, nobody commits or removes its directory.
  if (!all_written) return 0;
  observe_write(true);  // finished: this rank said so before the collective
  return finish_pending(pending_verdict_ == Verdict::kKeep);
}

std::int64_t Recovery::commit_pending() {
  if (pending_step_ == 0) return 0;
  observe_write(true);
  if (consensus_.world_size() > 1) {
    // Rank 0 commits only once every rank's file is written: each has waited for its own.
    (void)consensus::gather_values(consensus_, pending_failed_ ? 0 : 1, pending_step_, device());
  }
  return finish_pending(pending_verdict_ != Verdict::kDrop);
}

}  // namespace stepguard
