/*
 * Recovery: everything that puts training back to an earlier state, and its agreement across
 * ranks. It names what a snapshot or checkpoint holds (the parameters, the tracked module buffers
 * and the optimizer port's state), owns the RAM snapshots (the copies and their book: cadence,
 * confirmation, the decision state each holds; the step controller asks it through
 * SnapshotHolder), agrees on a rollback target (the newest snapshot every rank holds intact),
 * writes disk checkpoints and commits them once the next step confirms them, counts them, and
 * resumes from disk only after the whole checkpoint has been checked against the live model on
 * every rank.
 *
 * Off the training thread: a RAM snapshot's tensors are copied in the background while the next
 * forward and backward run (begin_snapshot() returns at once; finish_snapshot() waits), and a
 * disk checkpoint is written in the background from the RAM copy of its step (one in flight per
 * rank; a checkpoint due while one is still being written is skipped and counted). Every method
 * that reads the snapshots waits for the copy in flight first; the engine calls finish_snapshot()
 * before the optimizer next changes what the copy reads.
 *
 * Internal to the engine. Not thread-safe: the training thread drives it; the background threads
 * only run the copies and writes it started.
 */
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "csrc/checkpoint/background.h"
#include "csrc/checkpoint/payload.h"
#include "csrc/checkpoint/snapshot.h"
#include "csrc/consensus/consensus.h"
#include "plugin/src/optimizer_port.h"
#include "plugin/src/snapshot_book.h"

namespace stepguard {

struct RecoveryConfig {
  std::int64_t snapshot_every = 0;  ///< RAM snapshot cadence in applied steps (0: none)
  std::int64_t snapshot_keep = 0;   ///< RAM snapshots held
  std::string checkpoint_dir;       ///< empty: no disk checkpoints
  std::int64_t disk_every = 0;
  int disk_keep = 3;
  std::string run_id;  ///< the run its checkpoints belong to; empty: chosen at the first step
};

/// A rollback that cannot happen: the run must stop (the message says why).
class RollbackFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Disk checkpoints so far on this rank: one count each, kept here only.
struct CheckpointCounts {
  std::int64_t written = 0;  ///< made visible (committed)
  std::int64_t failed = 0;   ///< writes or commits that failed
  std::int64_t skipped = 0;  ///< due while one was still pending
};

/// What Recovery tells as it happens (on the training thread): a checkpoint made visible (its
/// step and the seconds its write took), or one failed or skipped (step 0).
struct CheckpointEvent {
  enum class Kind { kWritten, kFailed, kSkipped } kind;
  std::int64_t step = 0;
  double write_seconds = 0.0;
};

class Recovery final : public SnapshotHolder {
 public:
  Recovery(consensus::Consensus& consensus, OptimizerPort& port, RecoveryConfig config);
  /// Waits for the copy and the write in flight (a pending checkpoint stays pending on disk).
  ~Recovery() override;
  Recovery(const Recovery&) = delete;
  Recovery& operator=(const Recovery&) = delete;

  /// Module buffers snapshots and checkpoints also hold.
  void track_buffers(std::vector<at::Tensor> buffers) { buffers_ = std::move(buffers); }
  const std::vector<at::Tensor>& tracked_buffers() const noexcept { return buffers_; }
  /// What snapshots and checkpoints hold: "param.<i>", "buffer.<i>", "optimizer.<port name>".
  std::vector<NamedTensor> training_tensors() const;

  // RAM snapshots.
  /// Whether a RAM snapshot is due after `step` with `outcome`.
  bool snapshot_due(std::int64_t step, Outcome outcome) const noexcept {
    return ring_ && book_.due(step, outcome);
  }
  /// Starts the snapshot of the state after `step`, holding `guard_words` (the decision state):
  /// the optimizer's opaque bytes, the RNG state and the tracked buffers (a forward pass updates
  /// those) are captured now; parameters and optimizer state tensors are copied in the background
  /// and must not change before finish_snapshot(). Throws (and starts nothing) when the opaque
  /// bytes cannot be taken.
  void begin_snapshot(std::int64_t step, std::vector<std::int64_t> guard_words);
  /// begin_snapshot() then finish_snapshot(): the snapshot is held when it returns.
  void take_snapshot(std::int64_t step, std::vector<std::int64_t> guard_words) {
    begin_snapshot(step, std::move(guard_words));
    finish_snapshot();
  }
  /// Waits for the copies in flight: the snapshot joins the ring, and the host copy a disk write
  /// makes of its step is complete. Throws what made the snapshot's copy fail (the book then
  /// forgets it and the oldest snapshot whose buffers it refilled).
  void finish_snapshot();
  /// The step of the snapshot being copied, or 0.
  std::int64_t snapshot_in_flight() const noexcept {
    return ring_ && ring_->in_flight().valid() ? ring_->in_flight().step() : 0;
  }
  // SnapshotHolder: the book, and the copies kept to it.
  void on_step(std::int64_t step, bool clean) override;
  /// The step every rank restores: this rank's newest candidate whose copies pass their checksum,
  /// agreed by MIN across ranks (one collective); the damaged ones are dropped. Throws
  /// RollbackFailure when snapshots existed but none is intact, or a rank lacks the agreed one.
  std::optional<RollbackTarget> roll_back(std::int64_t step, bool replicas_diverged) override;
  /// A replica check passed at `step`: the snapshots taken before it hold equal replicas.
  void replicas_agreed_before(std::int64_t step) noexcept { book_.replicas_agreed_before(step); }
  /// Writes the snapshot of `step` back (tensors in place, optimizer state, RNG).
  void restore_snapshot(std::int64_t step);
  /// Forgets every snapshot (after the guard's state was replaced).
  void clear_snapshots();
  /// The copies (tests and tools), once the copy in flight has landed.
  const checkpoint::SnapshotRing* ring() {
    finish_snapshot();
    return ring_.get();
  }
  std::size_t snapshots_held() {
    finish_snapshot();
    return ring_ ? ring_->size() : 0;
  }
  std::int64_t snapshot_bytes() {
    finish_snapshot();
    return ring_ ? ring_->bytes() : 0;
  }

  // Disk checkpoints.
  /// Before the first step: agrees on the run id (the given one, the one resumed, or rank 0's
  /// random one) and refuses (c10::Error, on every rank) a checkpoint directory that holds
  /// another run's checkpoints unless this run resumed from it. Does nothing without checkpoints.
  void claim_checkpoint_dir(std::int64_t step);
  /// The run id of this run's checkpoints ("" before claim_checkpoint_dir or resume).
  const std::string& run_id() const noexcept { return run_; }
  bool disk_due(std::int64_t step, bool applied) const noexcept;
  /// Starts writing this rank's file of `record.step` in the background, from the RAM snapshot of
  /// that step when one is taken (else from a host copy made first, which finish_snapshot() also
  /// waits for); the checkpoint stays pending until settle_pending(). Returns false, writing
  /// nothing, when a checkpoint is still pending (one in flight at a time: the due one is skipped,
  /// logged and counted). A write that fails (disk full, permissions) is logged and counted when
  /// it is found finished, never thrown: training goes on, the commit finds the file missing and
  /// discards the checkpoint, the last good one stays.
  bool write_checkpoint(const checkpoint::GuardRecord& record);
  /// The step of the pending checkpoint (being written, or written and not yet settled), or 0.
  std::int64_t pending_checkpoint() const noexcept { return pending_step_; }
  /// What this rank tells the others before a step's collective: true unless its write of the
  /// pending checkpoint is still running. Never blocks; a failed write is logged and counted here.
  bool checkpoint_written();
  /// After step `step`: the first step after the pending checkpoint judges it (kept when `clean`).
  /// Once `all_written` (every rank's write has finished, as the step's collective agreed), a kept
  /// checkpoint becomes visible (rank 0 writes the manifest) and a judged-bad one is removed.
  /// Returns the step made visible, or 0 (also when the commit failed: logged and counted).
  std::int64_t settle_pending(std::int64_t step, bool clean, bool all_written);
  /// Makes the pending checkpoint visible now (end of a run; call it on every rank): waits for
  /// this rank's write and, with several ranks, for every rank's (one collective). Returns its
  /// step, or 0.
  std::int64_t commit_pending();
  /// Waits for this rank's write in flight; a failure is logged and counted now. The checkpoint
  /// stays pending (it becomes visible at the next step, or at commit_pending()).
  void wait_for_checkpoint();
  const CheckpointCounts& checkpoint_counts() const noexcept { return counts_; }
  /// The count of checkpoints written, as a resumed or loaded record holds it.
  void set_checkpoints_written(std::int64_t n) noexcept { counts_.written = n; }
  /// Told every checkpoint event as it happens (the engine's metrics); none by default.
  void on_checkpoint_event(std::function<void(const CheckpointEvent&)> observer) {
    observer_ = std::move(observer);
  }
  /// Tests only: called on the writer thread as each checkpoint write starts, with its step (an
  /// empty function: none). Lets a test hold a write in flight without timing anything.
  static void set_write_hook_for_testing(std::function<void(std::int64_t)> hook);

  /// Restores the newest checkpoint under `dir` that every rank holds intact and that
  /// `check_record` accepts (it throws to refuse), after checking all of it on every rank.
  /// Returns its record, or nothing when there is none (nothing changed). Refuses (c10::Error
  /// naming both world sizes) when the newest checkpoint was saved by another number of ranks.
  std::optional<checkpoint::GuardRecord> resume(
      const std::string& dir, const std::function<void(const checkpoint::GuardRecord&)>& check);

 private:
  /// Throws CheckpointError (or c10::Error) naming `source` unless `saved` fits the live model.
  void check_restorable(const std::vector<NamedTensor>& saved, const std::string& opaque,
                        const checkpoint::RngState& rng, const std::string& source) const;
  /// Writes `saved` back; `settings`: the optimizer's hyper-parameters too (a disk checkpoint).
  void restore(const std::vector<NamedTensor>& saved, const std::string& opaque,
               const checkpoint::RngState& rng, const std::string& source, bool settings);
  std::vector<checkpoint::CheckpointEntry> resumable_entries(const std::string& dir) const;
  void check_world_size(const std::vector<checkpoint::CheckpointEntry>& entries) const;
  std::int64_t newest_loadable(const std::vector<checkpoint::CheckpointEntry>& entries,
                               std::int64_t bound) const;
  bool load_agreed(const std::vector<checkpoint::CheckpointEntry>& entries, std::int64_t step,
                   const std::function<void(const checkpoint::GuardRecord&)>& check,
                   std::optional<checkpoint::DecodedPayload>* loaded) const;
  at::Device device() const;
  /// training_tensors() with the tracked buffers cloned: a copy made in the background must not
  /// read them (the next forward pass updates running statistics in place).
  std::vector<NamedTensor> frozen_tensors() const;
  checkpoint::BackgroundThread& writer();
  /// Takes in the outcome of this rank's write once it has finished (waiting for it when `wait`).
  void observe_write(bool wait);
  /// The pending checkpoint's write failed on this rank: marked, counted and logged.
  void write_failed(const char* why);
  /// Commits (when `keep`) or removes the pending checkpoint (rank 0); it is no longer pending.
  std::int64_t finish_pending(bool keep);

  consensus::Consensus& consensus_;
  OptimizerPort& port_;
  RecoveryConfig config_;
  std::vector<at::Tensor> buffers_;
  SnapshotBook book_;
  std::unique_ptr<checkpoint::SnapshotRing> ring_;
  std::string run_;           ///< this run's id in its checkpoints
  std::string resumed_from_;  ///< the directory resume() loaded from
  bool claimed_ = false;
  int dir_lock_ = -1;  ///< rank 0's lock on checkpoint_dir (lock_checkpoint_dir), while it lives
  bool commit(std::int64_t step);
  void discard(std::int64_t step) noexcept;
  /// Deletes checkpoint directories the commit hid, on the writer thread.
  void remove_later(std::vector<std::string> hidden) noexcept;

  // The pending checkpoint: written (or being written) by this rank, not yet settled.
  enum class Verdict { kOpen, kKeep, kDrop };  ///< as the step after it judged it
  std::int64_t pending_step_ = 0;
  Verdict pending_verdict_ = Verdict::kOpen;
  std::future<void> pending_write_;        ///< this rank's write on the writer thread
  bool pending_seen_ = false;              ///< the write's outcome has been taken in
  bool pending_failed_ = false;            ///< this rank could not write the pending checkpoint
  std::shared_ptr<double> pending_timer_;  ///< seconds the write took, set by the writer
  double pending_seconds_ = 0.0;
  CheckpointCounts counts_;
  std::function<void(const CheckpointEvent&)> observer_;
  void count(CheckpointEvent event);
  checkpoint::SnapshotCopy disk_copy_;     ///< a host copy made for a checkpoint alone, in flight
  checkpoint::SnapshotCopy pending_copy_;  ///< that copy, until the write of it has finished
  /// The host copy of the last checkpoint written from a copy of its own: the next such copy
  /// refills its buffers (fresh host memory is slow to fault in; memory stays one copy).
  std::shared_ptr<const checkpoint::Snapshot> disk_spare_;
  std::unique_ptr<checkpoint::BackgroundThread> writer_;  ///< last: joined first
};

}  // namespace stepguard
