/*
 * Replay: runs a policy offline over a recorded trace (the JSONL event log a guard writes with
 * trace_every_step, or lines written by hand) and prints the decisions it would have taken, one
 * trace line per step, including loss_scale and lr_factor. The decision code is the live guard's,
 * so a policy can be tuned on past incidents.
 *
 * A trace line needs `step` and either `loss` or `loss_nonfinite_ranks`; `grad_norm`, `nan`,
 * `inf` (or `nonfinite`) default to a clean step. null stands for a non-finite number. The inputs
 * are what the recorded run saw: a replay cannot know how the run would have gone had it decided
 * differently.
 */
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>

namespace stepguard {

struct ReplayOptions {
  std::string policy_file;
  std::string trace_file;
  /// Loss scaling with GradScaler's defaults when the policy has no loss_scale section.
  bool loss_scaling = false;
  /// The run's framework decided the loss scale (the trace of a framework integration's guard):
  /// the policy's loss_scale section turns no scaler of the guard's on, as in the run.
  bool framework_scale = false;
};

struct ReplaySummary {
  std::int64_t steps = 0;
  std::int64_t applied = 0;
  std::int64_t skipped = 0;
  std::int64_t rolled_back = 0;
  bool aborted = false;
  std::int64_t abort_step = 0;
  double loss_scale = 1.0;
  double lr_factor = 1.0;
};

/// Replays `options.trace_file` through `options.policy_file`, writing one JSON line per step to
/// `out`; stops after an abort, as a live run does. Throws std::runtime_error naming the file
/// (and line) for an unreadable policy or trace; nothing is written for a bad policy.
ReplaySummary replay_trace(const ReplayOptions& options, std::ostream& out);

}  // namespace stepguard
