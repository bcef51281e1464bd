/*
 * The engine's side of the parallel layout (stepguard/layout.h): a port's placements resolved
 * into the copy count of every gradient, and the one check at construction that the ranks' lists
 * fit together. Internal to the engine (not installed). Not thread-safe: the training thread.
 */
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/consensus/consensus.h"
#include "stepguard/layout.h"

namespace stepguard {

/// One rank's layout, resolved.
struct ResolvedLayout {
  std::vector<int> copies;            ///< per parameter: ranks holding this gradient (0: not here)
  bool all_replicas = true;           ///< every parameter a replica of every rank
  std::int64_t replica_tensors = 0;   ///< parameters held by every rank
  std::int64_t replica_elements = 0;  ///< their elements
  double distinct_elements = 0.0;     ///< the other parameters' elements, each over its copies
};

/// Resolves `layout` (one Placement per parameter, or empty: every parameter a replica, or a
/// shard with `sharded_gradients`) for a group of `world_size`. Throws c10::Error naming the
/// parameter when a placement is not possible (copies outside [1, world_size]), the list has the
/// wrong length, or both the layout and sharded_gradients are given.
ResolvedLayout resolve_layout(const std::vector<Placement>& layout,
                              const std::vector<at::Tensor>& params,
                              const std::vector<std::string>& names, bool sharded_gradients,
                              int world_size);

/// Checks on every rank, in one collective, that the ranks' lists fit together: the replicas
/// alike on every rank (count and elements), the other gradients' copies adding up to whole
/// elements. Throws c10::Error on every rank, naming each rank's counts, when they do not.
/// Returns whether every rank holds replicas only (then replicas can be fingerprinted, and
/// blame needs no exchange). The collective's buffer is on `device` (the parameters'). One
/// process: no collective, `mine.all_replicas`.
bool reconcile_layouts(consensus::Consensus& consensus, const ResolvedLayout& mine,
                       const at::Device& device);

}  // namespace stepguard
