/*
 * The engine's side of the parallel layout (stepguard/layout.h): a port's placements resolved
 * into the copy count of every gradient, and the one check at construction that the ranks fit
 * together: their lists, and the settings that must agree across ranks. Internal to the engine (not
 * installed). Not thread-safe: the training thread.
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
  /// The other parameters holding elements here, each over its copies: every part held by n
  /// ranks adds n times 1/n, so the ranks' sum is whole unless a placement names ranks that do
  /// not hold it (one rank's shard(2) where the other's is absent()).
  double distinct_tensors = 0.0;
};

/// Resolves `layout` (one Placement per parameter, or empty: every parameter a replica, or a
/// shard with `sharded_gradients`) for a group of `world_size`. Throws c10::Error naming the
/// parameter when a placement is not possible (copies outside [1, world_size]), the list has the
/// wrong length, or both the layout and sharded_gradients are given.
ResolvedLayout resolve_layout(const std::vector<Placement>& layout,
                              const std::vector<at::Tensor>& params,
                              const std::vector<std::string>& names, bool sharded_gradients,
                              int world_size);

/// What must be the same on every rank for the ranks to decide alike and to meet in the same
/// collectives: the policy (as explained in words: every rule, detector and limit), whether a
/// checkpoint directory is given and the cadence, loss scaling, sharded_gradients.
struct RankSettings {
  std::uint64_t policy_digest = 0;
  bool checkpoint_dir = false;
  std::int64_t disk_every = 0;
  bool loss_scaling = false;
  bool sharded_gradients = false;
  bool enabled = true;
};

/// A 64-bit FNV-1a digest of `text`.
std::uint64_t text_digest(const std::string& text) noexcept;

/// Checks on every rank, in one collective, that the ranks fit together: their settings alike
/// (`settings`), their lists too: the replicas alike on every rank (count and elements), the
/// other gradients' copies adding up to whole elements and whole tensors. Throws c10::Error on
/// every rank, naming what differs and each rank's value or counts, when they do not. Returns
/// whether every rank holds replicas only (then replicas can be fingerprinted, and blame needs no
/// exchange). The collective's buffer is on `device` (the parameters'). One process: no collective,
/// `mine.all_replicas`.
bool reconcile_ranks(consensus::Consensus& consensus, const ResolvedLayout& mine,
                     const RankSettings& settings, const at::Device& device);

}  // namespace stepguard
