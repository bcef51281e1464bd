/*
 * The per-step buffer: the one fp64 tensor that ONE sum all-reduce carries across ranks each step.
 * This file is its only owner: it names the slots, packs what a rank contributes (inspection's
 * block, the loss, its fault flag and state digest), and unpacks the sums into GlobalStats, with
 * the majority vote over the digests.
 *
 * Layout: inspection's block (stepguard::inspect_slot, written by inspection through
 * inspection_block()), then the loss sum, the count of ranks with a non-finite loss, the count of
 * ranks reporting, then world_size fault flags and world_size digests. Counts are exact in fp64 up
 * to 2^53; digests are masked to 52 bits so every rank reads them back exactly.
 *
 * Not here: running the collective (consensus.h) or what the numbers mean (policy). Not
 * thread-safe: one per step, on the training thread.
 */
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "csrc/core/stats.h"

namespace stepguard {
namespace consensus {

namespace step_slot {
constexpr int kInspection = 0;                                ///< inspection's block starts here
constexpr int kLossSum = kInspection + inspect_slot::kCount;  ///< sum of the finite local losses
constexpr int kLossNonfinite = kLossSum + 1;                  ///< ranks whose loss is NaN/Inf
constexpr int kRanksReporting = kLossNonfinite + 1;           ///< each rank adds 1
constexpr int kFixed = kRanksReporting + 1;                   ///< number of fixed slots
/// Rank r's fault flag (1 when it saw a non-finite gradient or loss).
constexpr int rank_fault(int rank) noexcept { return kFixed + rank; }
/// Rank r's state digest.
constexpr int rank_digest(int world_size, int rank) noexcept { return kFixed + world_size + rank; }
/// Length of the buffer for `world_size` ranks.
constexpr int size(int world_size) noexcept { return kFixed + 2 * world_size; }
/// Digests are masked to the integers fp64 holds exactly.
constexpr std::uint64_t kDigestMask = (std::uint64_t{1} << 52) - 1;
}  // namespace step_slot

class StepBuffer {
 public:
  /// A zeroed buffer for `rank` of `world_size`, on `device` (the gradients').
  StepBuffer(int rank, int world_size, const at::Device& device);

  /// The block inspection writes (inspect_slot order), a view into the buffer.
  at::Tensor inspection_block() const;
  /// Adds this rank's loss, fault flag and state digest (masked to 52 bits). Device ops only:
  /// nothing is read back before the collective. Call after inspection has written its block.
  void pack(const at::Tensor& loss, std::uint64_t digest);
  /// The whole buffer, for the collective.
  at::Tensor& tensor() noexcept { return buffer_; }
  /// After the sum: the one read to the host, into the agreed statistics. Throws c10::Error
  /// naming `step` when not every rank reported. `sharded_gradients`: the ranks hold parts of the
  /// gradients, so their sums of squares add up; otherwise they hold the same averaged gradient
  /// and it counts once.
  GlobalStats unpack(std::int64_t step, bool sharded_gradients) const;

 private:
  int rank_;
  int world_size_;
  at::Tensor buffer_;
};

/// Masks a 64-bit state digest to what the step buffer carries exactly.
constexpr std::uint64_t mask_digest(std::uint64_t digest) noexcept {
  return digest & step_slot::kDigestMask;
}

}  // namespace consensus
}  // namespace stepguard
