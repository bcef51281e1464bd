/*
 * What a guard knows about itself, as one plain value (GuardedOptimizer::stats(), and stats() in
 * Python with the same field names): the step counter, totals by outcome, the knobs the policy
 * turns, the data position, snapshot and checkpoint counts, the collectives' cost, and where the
 * last step's time went. A copy: later steps do not change it.
 */
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "stepguard/report.h"

namespace stepguard {

/// Running totals over the guard's life.
struct GuardTotals {
  std::int64_t steps = 0;
  std::int64_t applied = 0;
  std::int64_t skipped = 0;
  std::int64_t rolled_back = 0;  ///< in-process rollbacks to a RAM snapshot
  std::int64_t aborted = 0;
  std::int64_t incidents = 0;
  std::int64_t snapshots = 0;  ///< RAM snapshots taken
};

struct GuardStats {
  /// Guarded steps taken so far (reports number steps from 1).
  std::int64_t step_count = 0;
  GuardTotals totals;
  /// True once the policy aborted; step() then refuses to run.
  bool aborted = false;
  /// Bad steps in a row now (0 after a clean step), and over the run.
  std::int64_t consecutive_bad_steps = 0;
  std::int64_t bad_steps_total = 0;
  /// The current loss scale (1 without loss scaling).
  double loss_scale = 1.0;
  /// The factor the guard applies to every param group's learning rate in the optimizer step (1
  /// unless the policy lowered it; the optimizer's own lr values stay as the loop set them).
  double lr_factor = 1.0;
  /// This rank and the number of ranks agreeing (1 without a process group).
  int rank = 0;
  int world_size = 1;
  /// Batches consumed: one per step() plus every batches_to_skip the guard asked for.
  /// Checkpoints save it and resume() restores it: continue reading the data from there.
  std::int64_t data_position = 0;
  /// Data ranges skipped after rollbacks, as (first batch, count), oldest first.
  std::vector<std::pair<std::int64_t, std::int64_t>> skipped_ranges;
  /// RAM snapshots held now, and their host bytes.
  std::int64_t snapshots_held = 0;
  std::int64_t snapshot_bytes = 0;
  /// Disk checkpoints made visible, writes or commits that failed on this rank, and checkpoints
  /// skipped because the previous one was still being written.
  std::int64_t checkpoints_written = 0;
  std::int64_t checkpoints_failed = 0;
  std::int64_t checkpoints_skipped = 0;
  /// Collectives issued so far: one per step; with several ranks, two more on an incident step
  /// (the per-rank rows naming the ranks, and the agreement on causes).
  std::int64_t collective_calls = 0;
  /// Bytes the guard's collectives carried so far.
  std::int64_t collective_bytes = 0;
  /// Bytes each step's collective carries: a fixed size, the same at any world size.
  std::int64_t step_buffer_bytes = 0;
  /// Where the last step()'s time went, stage by stage (zeros before the first step).
  StageSeconds last_step_seconds;
  /// The URL of the metrics ("http://127.0.0.1:9464/metrics", what a scrape config or curl
  /// takes), or empty when metrics are off.
  std::string metrics_endpoint;
};

}  // namespace stepguard
