/*
 * Placement: how the ranks of the guard's group hold one parameter's gradient, so that the guard
 * counts every gradient element of the job once, in the grad norm, the non-finite count and blame,
 * whatever the parallel layout:
 *
 *   data parallel        every rank holds the same averaged gradient       Placement::replica()
 *   tensor parallel      a layernorm or bias every TP rank holds a copy of Placement::replicated(n)
 *                        (n = ranks holding that copy: TP size x DP size)
 *   sharded              this rank's part of a gradient (ZeRO, Megatron's    Placement::shard(n)
 *                        distributed optimizer, a TP-split weight); n ranks hold this same part
 *                        (1 with a sharded optimizer; the DP size for a TP shard under plain DP)
 *   pipeline parallel    the parameter lives on another stage              Placement::absent()
 *
 * A port hands the engine one Placement per parameter (OptimizerPort::layout()); ranks may hold
 * different lists. Every rank's contribution to the one per-step all-reduce is weighted by
 * 1 / copies, so the sum over ranks counts each distinct element once (the step buffer keeps its
 * fixed size whatever the lists). Plain values; not thread-safe to mutate, safe to copy.
 */
#pragma once

#include <cstdint>
#include <string>

namespace stepguard {

struct Placement {
  enum class Kind : std::uint8_t {
    kReplica,     ///< every rank of the group holds an identical copy
    kReplicated,  ///< an identical copy on `copies` ranks of the group
    kShard,       ///< a part of a larger gradient; `copies` ranks hold this same part
    kAbsent,      ///< not held on this rank (another pipeline stage): never inspected
  };
  Kind kind = Kind::kReplica;
  /// Ranks holding this identical gradient; 0 for kReplica (every rank) and kAbsent.
  int copies = 0;

  /// Held identically by every rank (data parallel): one replica's norm counts.
  static Placement replica() noexcept { return {Kind::kReplica, 0}; }
  /// An identical copy on `copies` ranks (tensor-parallel duplicates): counted once.
  static Placement replicated(int copies) noexcept { return {Kind::kReplicated, copies}; }
  /// This rank's part of a sharded gradient, held by `copies` ranks (norms add across parts).
  static Placement shard(int copies = 1) noexcept { return {Kind::kShard, copies}; }
  /// Not on this rank.
  static Placement absent() noexcept { return {Kind::kAbsent, 0}; }

  /// The ranks holding this gradient in a group of `world_size` (0: none here).
  int copies_in(int world_size) const noexcept {
    if (kind == Kind::kReplica) return world_size;
    if (kind == Kind::kAbsent) return 0;
    return copies;
  }
  bool operator==(const Placement& o) const noexcept {
    return kind == o.kind && copies == o.copies;
  }
  bool operator!=(const Placement& o) const noexcept { return !(*this == o); }
};

/// "replica", "replicated(4)", "shard(1)", "absent".
std::string to_string(const Placement& p);

}  // namespace stepguard
