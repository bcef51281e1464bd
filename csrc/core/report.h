/*
 * What a guarded step tells the training loop: the StepReport, and the Incident it carries when a
 * detector fired. Built in one place (the step engine's record stage, which `stepguard replay`
 * shares); read by the loop, the trace writer, the metrics and the incident report. Also where
 * the step's time went (StageSeconds), which the engine measures as it runs the stages.
 *
 * Installed with the public headers (stepguard/types.h includes it).
 * Plain values: copy freely.
 */
// Include guard, not #pragma once: the build and install copy this header to
// stepguard/report.h for the public headers, and the two copies must count as one.
#ifndef STEPGUARD_CORE_REPORT_H_
#define STEPGUARD_CORE_REPORT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "vocabulary.h"  // beside it, here and in the installed stepguard/

namespace stepguard {

/// The cause one rank found for an incident on its own evidence.
struct RankCause {
  int rank = 0;
  Cause cause = Cause::kUnknown;
};

/// One incident: a step where a detector fired and the policy acted.
struct Incident {
  std::int64_t step = 0;
  Signal signal = Signal::kNonfiniteGrad;  ///< the first signal raised
  Action action = Action::kApply;          ///< the strongest action taken
  /// Root-cause class agreed for the job: of the causes the origin ranks found on their own
  /// evidence, the first in the debugging order (data, forward, precision_overflow, divergence,
  /// backward, hardware_suspect, unknown); the same on every rank.
  Cause cause = Cause::kUnknown;
  std::vector<RankCause> rank_causes;  ///< each origin rank's own cause, by rank
  std::vector<std::string> tensors;    ///< offending gradients on this rank, in backward order
  /// The ranks the fault came from: those with evidence from before the gradient average (a
  /// non-finite loss, bad inputs, a non-finite probe) when any has it, else those whose
  /// gradients were non-finite (less those whose replay came out clean while another's
  /// reproduced). Empty when no rank saw anything of its own (a spike of the agreed loss), and
  /// when origin_unknown.
  std::vector<int> ranks;
  /// The gradients reached the guard already reduced into shards, with no hook before the
  /// reduction (FSDP2), and their NaN/Inf was the only evidence: the rank that made it is not
  /// known (a rank's shard holds what every rank sent it). The evidence names the shards' ranks.
  bool origin_unknown = false;
  std::string reason;                 ///< the policy's: signals and the rules that fired
  std::vector<std::string> evidence;  ///< why the cause, one line each
  std::vector<std::string> fixes;     ///< what to try first
  std::string report;                 ///< path of the JSON incident report, when written
};

/// What guard.step(loss) returns to the training loop.
struct StepReport {
  Outcome outcome = Outcome::kApplied;
  std::int64_t step = 0;  ///< 1-based count of guarded steps, this one included
  double loss = 0.0;      ///< the agreed loss (mean over ranks); NaN when loss_given is false
  /// false when step() had no loss (gradients alone) on every rank: the loss detectors saw no
  /// value this step.
  bool loss_given = true;
  double grad_norm = 0.0;  ///< global L2 norm of the finite gradient elements
  double loss_scale = 1.0;
  double lr_factor = 1.0;
  std::int64_t nonfinite_count = 0;  ///< NaN/Inf gradient elements over all ranks
  std::vector<Action> actions;
  /// The strongest of `actions` (abort, rollback, lower_lr, drop_loss_scale, skip_batch, clip,
  /// alert; apply when none), which names the step and its incident; the trace carries it.
  Action action = Action::kApply;
  std::int64_t batches_to_skip = 0;  ///< batches the loop must drop before the next step
  /// With outcome kRolledBack: the step whose snapshot was restored. The loop continues from its
  /// current data position plus batches_to_skip (batches consumed since the snapshot are not
  /// replayed).
  std::int64_t rolled_back_to = 0;
  /// Decided one step late (the deferred verdict): the update ran, or was skipped on the device,
  /// before this report's decision was made.
  bool deferred = false;
  std::optional<Incident> incident;

  bool applied() const noexcept { return outcome == Outcome::kApplied; }
  bool aborted() const noexcept { return outcome == Outcome::kAborted; }
};

/// The first half of a guarded step (verdict()): what every rank agreed the step is, before
/// anything changed. A framework that runs its own update reads it, applies the update only when
/// applies(), with `lr_factor` and the clip below, and then calls settle(verdict, applied).
struct Verdict {
  std::int64_t step = 0;  ///< the step this verdict is for (1-based)
  /// kApplied: apply the update. kSkipped, kRolledBack, kAborted: do not (settle() drops the
  /// gradients, restores the snapshot or ends training).
  Outcome outcome = Outcome::kApplied;
  std::vector<Action> actions;
  Action action = Action::kApply;  ///< the strongest of `actions`
  /// The agreed global L2 norm of the finite gradient elements, every element of the job counted
  /// once (the parallel layout), before any clip: the total norm a framework's clip takes.
  double grad_norm = 0.0;
  /// With Action::kClip: the global norm the policy clips the gradients to (0: no clip of the
  /// policy's); a framework's own clip value adds to it (the smaller one wins).
  double clip_norm = 0.0;
  double loss_scale = 1.0;  ///< the scale this step's backward used
  double lr_factor = 1.0;   ///< every learning rate times this, for this step's update only
  std::int64_t nonfinite_count = 0;  ///< NaN/Inf gradient elements over all ranks
  bool loss_given = true;
  double loss = 0.0;                 ///< the agreed loss (NaN when no rank gave one)
  std::int64_t batches_to_skip = 0;  ///< with a rollback: batches to drop after it
  /// The guard that gave it (a number unique in the process): settle() takes its own only.
  std::uint64_t guard_id = 0;

  bool applies() const noexcept { return outcome == Outcome::kApplied; }
};

/// Wall time (steady clock) of one guarded step, stage by stage as DESIGN.md draws the step; the
/// stages add up to the whole step. `act` includes the wrapped optimizer's own step, which an
/// unguarded loop pays too: the guard's cost is everything else, plus `act` minus that step.
struct StageSeconds {
  double inspect = 0.0;   ///< argument checks, the fused pass over the gradients, the step buffer
  double agree = 0.0;     ///< the collective and its read to the host (incident steps: rank rows)
  double decide = 0.0;    ///< detectors, policy, the ranks' agreement on a rollback target
  double act = 0.0;       ///< apply (the optimizer step), skip or restore; disk checkpoint cadence
  double snapshot = 0.0;  ///< the RAM snapshot: starting its copy, and the wait at the start of a
                          ///< step for the last step's copy when it is not done yet
  double record = 0.0;    ///< forensics, the report, incident files, trace line, metrics

  double total() const noexcept { return inspect + agree + decide + act + snapshot + record; }
};

}  // namespace stepguard

#endif  // STEPGUARD_CORE_REPORT_H_
