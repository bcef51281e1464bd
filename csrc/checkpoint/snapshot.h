/*
 * RAM snapshots for in-process rollback: a ring of the newest K copies of everything training
 * continues from (named tensors: parameters, buffers, optimizer state; the optimizer's opaque
 * state bytes; the RNG state; the guard's decision state), taken on cadence.
 *
 * Which snapshots exist, when they are due and which are confirmed (by a clean next step) is the
 * step controller's bookkeeping (SnapshotBook), shared with `stepguard replay`; this ring holds the
 * copies, keyed by step, and keeps exactly the steps the book keeps.
 *
 * Copies are made off the calling thread: begin_take() captures the small parts (opaque bytes,
 * guard words, RNG) and returns; the tensors are copied and checksummed on the ring's background
 * thread while training runs its next forward and backward, and the snapshot joins the ring at
 * finish_take(). The caller must not change the tensors before then (the engine waits before the
 * optimizer next steps). Copies live in host memory; a full ring refills its oldest snapshot's
 * buffers (no allocation per snapshot) unless a disk write still reads them. CUDA tensors go to
 * pinned host memory by non-blocking copies on a side stream that waits for an event recorded on
 * each device's current stream at begin_take(), one stream synchronization per device before the
 * checksum; CPU tensors are memcpy'd. Not here: writing a snapshot back (the engine's recovery does
 * it through the optimizer port), disk checkpoints.
 *
 * Not thread-safe: the training thread owns the ring; only the copy in flight runs elsewhere.
 */
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "csrc/checkpoint/background.h"
#include "csrc/checkpoint/named_tensors.h"
#include "csrc/checkpoint/rng_state.h"

namespace stepguard {
namespace checkpoint {

/// One point training can continue from.
struct Snapshot {
  std::int64_t step = 0;             ///< the guard step after which it was taken
  std::vector<NamedTensor> tensors;  ///< host copies
  std::string opaque;                ///< the optimizer's opaque state bytes
  RngState rng;
  std::vector<std::int64_t> guard;  ///< the guard's decision state (StepController words)
  std::int64_t bytes = 0;           ///< host bytes held by the copies above
  std::uint64_t checksum = 0;       ///< XXH3-64 over the host copies, checked before a restore
};

/// A snapshot whose copy may still be running on a background thread: a handle shared by whoever
/// needs the copy (the ring, and a disk write of the same step). Thread-safety: finished() and
/// get() may be called from any thread; release_sources() only by the thread that started it.
class SnapshotCopy {
 public:
  SnapshotCopy() = default;
  /// A handle to a snapshot that is complete already.
  explicit SnapshotCopy(std::shared_ptr<const Snapshot> complete);

  bool valid() const noexcept { return state_ != nullptr; }
  std::int64_t step() const noexcept;
  /// Whether the copy has finished, well or not. Never blocks.
  bool finished() const;
  /// Waits for the copy: the snapshot, or what made the copy fail, rethrown.
  std::shared_ptr<const Snapshot> get() const;
  /// Waits for the copy however it went, then drops its references to the live tensors it read,
  /// on the calling thread (the one that started it: Python tensors are freed there, not in the
  /// background).
  void release_sources() const;

  struct State;  ///< internal to snapshot.cpp

 private:
  friend class SnapshotRing;
  friend SnapshotCopy start_copy(BackgroundThread&, std::int64_t, std::vector<NamedTensor>,
                                 std::string, std::vector<std::int64_t>,
                                 const std::shared_ptr<const Snapshot>&, bool);
  std::shared_ptr<State> state_;
};

/// Starts copying the state after `step` on `thread` and returns at once. Captured now, on the
/// calling thread: `opaque` and `guard_state` as given, the RNG state, and a host copy of any
/// tensor whose copy would run Python code (a subclass with __torch_dispatch__). Every other
/// tensor is read in the background and must not change until the copy has finished. `reuse`
/// (nobody else may write it) lends its host buffers: the copy refills those whose name, shape and
/// dtype match. Without `checksum` the snapshot's checksum stays 0 (a copy a disk write makes for
/// itself: the file gets its own). Throws only what the calling thread's part throws.
SnapshotCopy start_copy(BackgroundThread& thread, std::int64_t step,
                        std::vector<NamedTensor> tensors, std::string opaque,
                        std::vector<std::int64_t> guard_state,
                        const std::shared_ptr<const Snapshot>& reuse = nullptr,
                        bool checksum = true);

/// Tests only: called on the background thread as each copy starts, with its step (an empty
/// function: none). Lets a test hold a copy in flight without timing anything.
void set_copy_hook_for_testing(std::function<void(std::int64_t)> hook);

class SnapshotRing {
 public:
  /// Keeps at most `keep` (>= 1) snapshots.
  explicit SnapshotRing(std::size_t keep);
  /// Waits for the copy in flight.
  ~SnapshotRing();
  SnapshotRing(const SnapshotRing&) = delete;
  SnapshotRing& operator=(const SnapshotRing&) = delete;

  /// Starts the snapshot of the state after `step` (start_copy() on the ring's own thread; a take
  /// still in flight is finished first) and returns. The oldest snapshot beyond `keep` leaves the
  /// ring now; the copy refills its buffers unless a disk write still holds it.
  void begin_take(std::int64_t step, std::vector<NamedTensor> tensors, std::string opaque,
                  std::vector<std::int64_t> guard_state);
  /// Waits for the take in flight, if any: its snapshot joins the ring. Throws what made the copy
  /// fail; the ring then holds what it held before begin_take(), less the oldest it gave up.
  void finish_take();
  /// The copy in flight (invalid when none).
  const SnapshotCopy& in_flight() const noexcept { return taking_; }
  /// begin_take() then finish_take(): returns once every copy is complete.
  void take(std::int64_t step, const std::vector<NamedTensor>& tensors, std::string opaque,
            std::vector<std::int64_t> guard_state);

  /// The snapshot of `step`, in flight or held, as a handle (invalid when there is none): a disk
  /// write saves it from there, and the ring never refills it while such a handle lives.
  SnapshotCopy copy_of(std::int64_t step) const;
  /// The held snapshot of `step`, or nullptr (the one in flight is not held yet).
  const Snapshot* at(std::int64_t step) const;
  /// Whether the copies still match their checksum (host memory not corrupted).
  bool intact(const Snapshot& snapshot) const;
  /// Drops the snapshot of `step`, held or in flight (then when it lands).
  void drop(std::int64_t step);
  /// Drops every snapshot whose step is not in `steps`, held or in flight (then when it lands).
  void keep_only(const std::vector<std::int64_t>& steps);
  /// Drops every snapshot, waiting for the copy in flight (after a resume from disk).
  void clear() noexcept;

  /// Held snapshots and their host bytes (not the one in flight).
  std::size_t size() const noexcept { return ring_.size(); }
  std::int64_t bytes() const noexcept;

 private:
  BackgroundThread& thread();

  std::size_t keep_;
  std::deque<std::shared_ptr<Snapshot>> ring_;  ///< oldest first
  SnapshotCopy taking_;                         ///< the copy in flight
  bool drop_when_landed_ = false;               ///< the book let go of the step in flight
  std::unique_ptr<BackgroundThread> thread_;    ///< started at the first take
};

}  // namespace checkpoint
}  // namespace stepguard
