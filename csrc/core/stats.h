/*
 * The engine's internal values: what one rank saw in its gradients (LocalStats), what all ranks
 * agreed on (GlobalStats), what the detectors raised (Signals) and what the policy decided
 * (Decision), plus the slots inspection writes at the head of the step buffer. Modules exchange
 * these and nothing else; none of it is installed (the training loop sees stepguard/types.h).
 *
 * Standard library only. Plain values.
 */
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "csrc/core/vocabulary.h"

namespace stepguard {

/// The slots inspection fills, in the order it writes them. The step buffer (consensus) places
/// this block where it likes and reads it by these names; inspection writes nothing else.
namespace inspect_slot {
constexpr int kNanCount = 0;            ///< NaN gradient elements
constexpr int kInfCount = 1;            ///< +/-Inf gradient elements
constexpr int kSumSquares = 2;          ///< sum of squares of the finite elements (0 on overflow)
constexpr int kSumSquaresOverflow = 3;  ///< 1 when the finite sum of squares overflowed fp64
constexpr int kCount = 4;               ///< length of the block
}  // namespace inspect_slot

/// What one rank found in its own gradients. Produced by inspection.
struct LocalStats {
  std::int64_t nan_count = 0;
  std::int64_t inf_count = 0;
  double sum_squares = 0.0;  ///< over finite elements, of g * inv_scale, in fp64
  bool sum_squares_overflow = false;
  std::int64_t num_tensors = 0;   ///< gradients inspected (undefined grads count, hold nothing)
  std::int64_t num_elements = 0;  ///< elements inspected
  std::vector<std::int64_t> nonfinite_tensors;  ///< indices (in parameter order) holding NaN/Inf
  std::vector<double> tensor_sum_squares;       ///< per tensor, for blame and clipping

  std::int64_t nonfinite_count() const noexcept { return nan_count + inf_count; }
};

/// What all ranks agreed on after the all-reduce. Identical on every rank.
struct GlobalStats {
  std::int64_t nan_count = 0;
  std::int64_t inf_count = 0;
  double sum_squares = 0.0;
  double grad_norm = 0.0;  ///< sqrt(sum_squares), of finite elements only
  bool sum_squares_overflow = false;
  /// Mean of the finite rank losses; when every given loss is bad: +Inf if each is +Inf, else
  /// NaN (and NaN when no rank gave one).
  double loss = 0.0;
  std::int64_t loss_nonfinite_ranks = 0;
  std::int64_t loss_given_ranks = 1;  ///< ranks whose step() had a loss (0: gradients alone)
  int world_size = 1;
  // Counts from the fixed-size step buffer: how many ranks saw something, not which.
  std::int64_t faulty_rank_count = 0;         ///< ranks with a non-finite gradient or loss
  std::int64_t input_bad_ranks = 0;           ///< ranks whose check_inputs() failed
  std::int64_t probe_bad_ranks = 0;           ///< ranks where a probe saw a non-finite value
  std::int64_t checkpoint_written_ranks = 0;  ///< ranks with no checkpoint write still running
  bool state_differs = false;                 ///< the guard-state digests are not all equal
  bool replica_checked = false;               ///< every rank fingerprinted its parameters this step
  bool replica_differs = false;               ///< ... and the fingerprints are not all equal
  // Which ranks: filled from the per-rank rows, gathered only when a count above says so.
  bool ranks_named = false;
  std::vector<int> faulty_ranks;       ///< ranks that saw a non-finite gradient or loss
  std::vector<int> desynced_ranks;     ///< ranks whose state digest differs from the majority
  std::vector<int> diverged_replicas;  ///< ranks whose parameters differ from the majority
  /// Where the fault came from: the ranks with evidence from before the gradient average (a
  /// non-finite loss, bad inputs, a non-finite probe) when any has it, else the faulty ranks
  /// (not under shards_unwatched: then origin_unknown).
  std::vector<int> origin_ranks;
  /// Set by the engine before the ranks are named: the gradients reach the guard reduced into
  /// shards (the port's gradients_reduced_into_shards(): FSDP2's DTensors) and no hook saw them
  /// before the reduction (they get no gradient watch). A NaN one rank made before the
  /// reduce-scatter lands in the shard of the rank that owns those elements, so a rank whose shard
  /// holds it need not be where it came from.
  bool shards_unwatched = false;
  /// With shards_unwatched: the gradients' NaN/Inf is the only evidence (no rank's loss, inputs,
  /// probe or state was bad), so which rank made it is not known; origin_ranks stays empty and
  /// faulty_ranks names the shards that hold it.
  bool origin_unknown = false;
  /// The rank losses' spread, from the sum of their squares: an upper bound of the largest finite
  /// rank loss (Samuelson: mean + sd * sqrt(n - 1)), equal to it when one rank stands out from
  /// ranks that agree. The loss detectors' recent ratio judges it, so that one rank's spike is
  /// not averaged away at any world size. NaN without a finite loss.
  double loss_max_bound = std::numeric_limits<double>::quiet_NaN();
  /// The ranks' losses, filled with ranks_named on a loss-spike step (NaN where a rank gave none).
  std::vector<double> rank_losses;
  /// Set by the engine: an fp32 replay in this streak of non-finite steps reproduced it (the
  /// agreed cause was data, forward or backward), so the streak is not an fp16 overflow.
  bool overflow_ruled_out = false;
  /// Set by the engine when the framework's scaler owns the loss scale (DeepSpeed fp16): its scale
  /// and floor at this step (0: none). The policy reads them as it reads the guard's own scaler.
  double framework_loss_scale = 0.0;
  double framework_min_scale = 0.0;
  /// Set by the engine: the largest learning rate of the wrapped optimizer's groups before the
  /// guard's LR factor (NaN when the port cannot tell). The stall detector reads it.
  double largest_lr = std::numeric_limits<double>::quiet_NaN();
  /// The optimizer state check (detectors.optimizer_state): set on the steps it ran, before the
  /// update. Bad elements are NaN/Inf in any state tensor, or a finite value below zero in a
  /// second moment (whose square root the update takes): the update would write them into the
  /// weights. Summed over the ranks; the ranks are named from the per-rank rows.
  bool state_checked = false;
  std::int64_t state_bad_count = 0;
  std::vector<int> state_bad_ranks;

  std::int64_t nonfinite_count() const noexcept { return nan_count + inf_count; }
  /// "This step is non-finite": a NaN/Inf gradient element or loss on some rank. The one
  /// definition the policy, the loss scaler and forensics read.
  bool nonfinite() const noexcept { return nonfinite_count() > 0 || loss_nonfinite_ranks > 0; }
};

/// What a trend detector (csrc/policy/trend.h) saw when it raised its signal: the figures and
/// the sentence its incident's evidence carries.
struct TrendNote {
  Signal signal = Signal::kLossTrend;
  double level = 0.0;      ///< the figure judged now (a window's mean loss, a rank's excess, ...)
  double reference = 0.0;  ///< what it was judged against
  std::int64_t since = 0;  ///< the step the trend began
  std::string what;        ///< one sentence: what was seen
};

/// What the detectors raised on one step, plus the streak they track.
struct Signals {
  std::vector<Signal> raised;
  std::int64_t consecutive_bad_steps = 0;  ///< including this one when it is bad
  std::vector<int> desynced_ranks;         ///< with kRankDesync: the ranks that diverged
  std::vector<int> diverged_replicas;      ///< with kReplicaDivergence: whose parameters differ
  /// With a loss spike or kLossNotRecovered: the level the loss rose from (the recent median, or
  /// the EMA mean) and, for kLossNotRecovered, the watch that raised it.
  double loss_level = 0.0;
  double grad_norm_level = 0.0;      ///< the grad norm's EMA mean before the spike
  std::int64_t diverging_since = 0;  ///< step of the spike that began the watch
  std::int64_t escalations = 0;      ///< kLossNotRecovered raised in this watch, this one too
  std::vector<TrendNote> trends;     ///< one per trend signal raised

  bool has(Signal s) const noexcept {
    for (Signal r : raised) {
      if (r == s) return true;
    }
    return false;
  }
  bool any() const noexcept { return !raised.empty(); }
};

/// The parameters of a lower_lr action: multiply the LR factor by `factor`, not below `floor`;
/// recover linearly to 1 over `recover_over` good steps after `recover_after` good steps.
struct LrChange {
  double factor = 0.5;
  double floor = 0.0;
  std::int64_t recover_after = 0;
  std::int64_t recover_over = 0;
};

/// What the policy engine decided. A pure function of GlobalStats and engine state, so every
/// rank decides the same. The parameters below are meaningful only with their action.
struct Decision {
  Outcome outcome = Outcome::kApplied;
  std::vector<Action> actions;       ///< in a fixed order; see configs/policies/README.md
  std::int64_t batches_to_skip = 0;  ///< with kRollback: batches to drop after the restore
  double loss_scale_factor = 1.0;    ///< with kDropLossScale from a rule: scale *= this
  LrChange lower_lr;                 ///< with kLowerLr
  double clip_norm = 0.0;            ///< with kClip: scale the gradients to this global norm
  std::vector<std::string> rules;    ///< names of the rules and limits that fired
  std::string reason;                ///< one line, for logs and reports

  bool has(Action a) const noexcept {
    for (Action x : actions) {
      if (x == a) return true;
    }
    return false;
  }
};

/// The strongest of `actions`, which names an incident: abort, rollback, lower_lr,
/// drop_loss_scale, skip_batch, reset_moments, clip, alert; apply when none of them.
inline Action strongest_action(const std::vector<Action>& actions) noexcept {
  constexpr Action kByStrength[] = {
      Action::kAbort,     Action::kRollback,     Action::kLowerLr, Action::kDropLossScale,
      Action::kSkipBatch, Action::kResetMoments, Action::kClip,    Action::kAlert};
  for (Action strong : kByStrength) {
    for (Action a : actions) {
      if (a == strong) return a;
    }
  }
  return Action::kApply;
}

}  // namespace stepguard
