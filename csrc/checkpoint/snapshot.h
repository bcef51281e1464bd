/*
 * RAM snapshots for in-process rollback: a ring of the newest K copies of everything training
 * continues from (named tensors: parameters, buffers, optimizer state; the optimizer's opaque
 * state bytes; the RNG state; the guard's decision state), taken on cadence.
 *
 * Which snapshots exist, when they are due and which are confirmed (by a clean next step) is the
 * step controller's bookkeeping (SnapshotBook), shared with `stepguard replay`; this ring holds the
 * copies, keyed by step, and keeps exactly the steps the book keeps.
 *
 * Copies live in host memory; a full ring refills its oldest snapshot's buffers (no allocation
 * per snapshot). Copies of CUDA tensors go to pinned host memory by non-blocking copies on each
 * device's current PyTorch stream, with one synchronization per snapshot (not one per tensor)
 * before the checksum is computed; copies of CPU tensors are plain synchronous copies. Not here:
 * writing a snapshot back (the engine's recovery does it through the optimizer port), disk
 * checkpoints. Not thread-safe: the training thread owns the ring.
 */
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

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

class SnapshotRing {
 public:
  /// Keeps at most `keep` (>= 1) snapshots.
  explicit SnapshotRing(std::size_t keep);

  /// Copies the state after `step`. Drops the oldest beyond `keep`. CUDA tensors are read on
  /// their device's current stream (the stream that produced them); returns once every copy is
  /// complete.
  void take(std::int64_t step, const std::vector<NamedTensor>& tensors, std::string opaque,
            std::vector<std::int64_t> guard_state);
  /// The snapshot of `step`, or nullptr.
  const Snapshot* at(std::int64_t step) const;
  /// Whether the copies still match their checksum (host memory not corrupted).
  bool intact(const Snapshot& snapshot) const;
  /// Drops the snapshot of `step`, if held.
  void drop(std::int64_t step);
  /// Drops every snapshot whose step is not in `steps`.
  void keep_only(const std::vector<std::int64_t>& steps);
  /// Drops every snapshot (after a resume from disk).
  void clear() noexcept { ring_.clear(); }

  std::size_t size() const noexcept { return ring_.size(); }
  std::int64_t bytes() const noexcept;

 private:
  std::size_t keep_;
  std::deque<Snapshot> ring_;  ///< oldest first
};

}  // namespace checkpoint
}  // namespace stepguard
