/*
 * Recovery: everything that puts training back to an earlier state, and its agreement across
 * ranks. It names what a snapshot or checkpoint holds (the parameters, the tracked module buffers
 * and the optimizer port's state), keeps the RAM snapshot copies whose bookkeeping the step
 * controller keeps, agrees on a rollback target (the newest snapshot every rank holds intact),
 * writes disk checkpoints and commits them once the next step confirms them, and resumes from
 * disk only after the whole checkpoint has been checked against the live model on every rank.
 *
 * Internal to the engine. Not thread-safe: the training thread drives it.
 */
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "csrc/checkpoint/payload.h"
#include "csrc/checkpoint/snapshot.h"
#include "csrc/consensus/consensus.h"
#include "plugin/src/optimizer_port.h"

namespace stepguard {

struct RecoveryConfig {
  std::int64_t snapshot_keep = 0;  ///< RAM snapshots held (0: none)
  std::string checkpoint_dir;      ///< empty: no disk checkpoints
  std::int64_t disk_every = 0;
  int disk_keep = 3;
  std::string run_id;  ///< the run its checkpoints belong to; empty: chosen at the first step
};

/// A rollback that cannot happen: the run must stop (the message says why).
class RollbackFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Recovery {
 public:
  Recovery(consensus::Consensus& consensus, OptimizerPort& port, RecoveryConfig config);

  /// Module buffers snapshots and checkpoints also hold.
  void track_buffers(std::vector<at::Tensor> buffers) { buffers_ = std::move(buffers); }
  /// What snapshots and checkpoints hold: "param.<i>", "buffer.<i>", "optimizer.<port name>".
  std::vector<NamedTensor> training_tensors() const;

  // RAM snapshots.
  void take_snapshot(std::int64_t step, std::vector<std::int64_t> guard_words);
  /// The step every rank restores, given the confirmed snapshots (newest first): this rank's
  /// newest one whose copies pass their checksum, agreed by MIN across ranks; 0 for none. The
  /// damaged ones are dropped and listed in `damaged`. Throws RollbackFailure when snapshots
  /// existed but none is intact, or a rank lacks the agreed one.
  std::int64_t agree_rollback(std::int64_t step, const std::vector<std::int64_t>& confirmed,
                              std::vector<std::int64_t>* damaged);
  /// Writes the snapshot of `step` back (tensors in place, optimizer state, RNG).
  void restore_snapshot(std::int64_t step);
  /// Keeps only the snapshots of `steps` (the controller's book).
  void keep_snapshots(const std::vector<std::int64_t>& steps);
  /// The copies (tests and tools).
  const checkpoint::SnapshotRing* ring() const noexcept { return ring_.get(); }
  std::size_t snapshots_held() const noexcept { return ring_ ? ring_->size() : 0; }
  /// Whether the RAM snapshot of `step` is held.
  bool holds_snapshot(std::int64_t step) const { return ring_ && ring_->at(step) != nullptr; }
  std::int64_t snapshot_bytes() const noexcept { return ring_ ? ring_->bytes() : 0; }

  // Disk checkpoints.
  /// Before the first step: agrees on the run id (the given one, the one resumed, or rank 0's
  /// random one) and refuses (c10::Error, on every rank) a checkpoint directory that holds
  /// another run's checkpoints unless this run resumed from it. Does nothing without checkpoints.
  void claim_checkpoint_dir(std::int64_t step);
  /// The run id of this run's checkpoints ("" before claim_checkpoint_dir or resume).
  const std::string& run_id() const noexcept { return run_; }
  bool disk_due(std::int64_t step, bool applied) const noexcept;
  /// Writes this rank's file of `step`; it stays pending until settle_pending(). A write that
  /// fails (disk full, permissions) is logged and counted, never thrown: training goes on, the
  /// commit finds the file missing and discards the checkpoint, the last good one stays.
  void write_checkpoint(const checkpoint::GuardRecord& record);
  /// After step `step`: the checkpoint written after the step before becomes visible when
  /// `clean` (rank 0 writes the manifest), is removed otherwise. Returns the step made visible, or
  /// 0 (also when the commit failed: logged and counted).
  std::int64_t settle_pending(std::int64_t step, bool clean);
  /// Makes the pending checkpoint visible now (end of a run). Returns its step, or 0.
  std::int64_t commit_pending();
  /// Checkpoint writes or commits that failed on this rank so far.
  std::int64_t checkpoint_failures() const noexcept { return checkpoint_failures_; }
  double pending_write_seconds() const noexcept { return pending_seconds_; }

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
  void restore(const std::vector<NamedTensor>& saved, const std::string& opaque,
               const checkpoint::RngState& rng, const std::string& source);
  std::vector<checkpoint::CheckpointEntry> resumable_entries(const std::string& dir) const;
  void check_world_size(const std::vector<checkpoint::CheckpointEntry>& entries) const;
  std::int64_t newest_loadable(const std::vector<checkpoint::CheckpointEntry>& entries,
                               std::int64_t bound) const;
  bool load_agreed(const std::vector<checkpoint::CheckpointEntry>& entries, std::int64_t step,
                   const std::function<void(const checkpoint::GuardRecord&)>& check,
                   std::optional<checkpoint::DecodedPayload>* loaded) const;
  at::Device device() const;

  consensus::Consensus& consensus_;
  OptimizerPort& port_;
  RecoveryConfig config_;
  std::vector<at::Tensor> buffers_;
  std::unique_ptr<checkpoint::SnapshotRing> ring_;
  std::string run_;           ///< this run's id in its checkpoints
  std::string resumed_from_;  ///< the directory resume() loaded from
  bool claimed_ = false;
  std::int64_t pending_step_ = 0;  ///< written, waiting for the next step's confirmation
  std::int64_t checkpoint_failures_ = 0;
  bool pending_failed_ = false;  ///< this rank could not write the pending checkpoint
  bool commit(std::int64_t step);
  void discard(std::int64_t step) noexcept;
  double pending_seconds_ = 0.0;
};

}  // namespace stepguard
