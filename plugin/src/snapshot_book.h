/*
 * SnapshotBook: the RAM snapshots as the decision sees them (the steps that hold one, whether the
 * step after confirmed it, the decision state each holds), and SnapshotHolder, what the step
 * controller asks of them. One owner answers: Recovery in a live run (it keeps this book beside
 * the copies and agrees on a rollback target across ranks), a SnapshotBook alone in `stepguard
 * replay` and in tests.
 *
 * Torch-free. Internal to the engine (not installed). Not thread-safe.
 */
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "csrc/core/vocabulary.h"

namespace stepguard {

/// The snapshot a rollback restores: its step and the decision state it holds.
struct RollbackTarget {
  std::int64_t step = 0;
  std::vector<std::int64_t> words;  ///< StepController::encode() after that step
};

/// What the step controller asks of the snapshots held.
class SnapshotHolder {
 public:
  virtual ~SnapshotHolder() = default;
  /// After every decided step: a clean step confirms the snapshot of the step before; a step with
  /// any signal discards it (the update that produced it is the suspect).
  virtual void on_step(std::int64_t step, bool clean) = 0;
  /// For a rollback decided at `step`: the newest confirmed snapshot to restore (with
  /// `replicas_diverged`, only one taken while the replicas still agreed), forgetting every newer
  /// one; nothing when there is none. Live, every rank gets the same answer or an exception.
  virtual std::optional<RollbackTarget> roll_back(std::int64_t step, bool replicas_diverged) = 0;
};

class SnapshotBook : public SnapshotHolder {
 public:
  struct Entry {
    std::int64_t step = 0;
    bool confirmed = false;
    std::vector<std::int64_t> words;
  };
  /// A snapshot after every `every` applied steps (0: none), the newest `keep` held (at least 1).
  SnapshotBook(std::int64_t every, std::int64_t keep) : every_(every), keep_(keep) {}

  /// Whether a snapshot is due after `step` with `outcome`.
  bool due(std::int64_t step, Outcome outcome) const noexcept;
  /// Books the snapshot of `step` (forgetting the oldest beyond `keep`).
  void add(std::int64_t step, std::vector<std::int64_t> words);
  void on_step(std::int64_t step, bool clean) override;
  /// The newest confirmed snapshot (a single process holds every one it booked).
  std::optional<RollbackTarget> roll_back(std::int64_t step, bool replicas_diverged) override;

  /// Snapshots booked before `step` hold replicas that agreed (a replica check passed there).
  void replicas_agreed_before(std::int64_t step) noexcept { replicas_agreed_before_ = step; }
  /// Confirmed snapshots a rollback may go to, newest first.
  std::vector<std::int64_t> candidates(bool replicas_diverged) const;
  const Entry* at(std::int64_t step) const;
  /// Steps held, oldest first.
  std::vector<std::int64_t> steps() const;
  void drop(std::int64_t step);
  void drop_newer_than(std::int64_t step);
  void clear() noexcept { entries_.clear(); }

 private:
  std::int64_t every_;
  std::int64_t keep_;
  std::int64_t replicas_agreed_before_ = 0;
  std::deque<Entry> entries_;  ///< oldest first
};

}  // namespace stepguard
