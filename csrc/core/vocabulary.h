/*
 * The engine's words: what became of a step (Outcome), what the guard did (Action), what the
 * detectors raised (Signal) and the root cause forensics names (Cause), each with one name table
 * used both ways: to_string() for traces, JSON and metric labels, parse_*() for policy files,
 * traces and reports. Nobody else spells these names.
 *
 * Installed with the public headers (stepguard/types.h includes it):
 * the engine modules and the training loop share it. Standard library only. Thread-safe (constant
 * data).
 */
// Include guard, not #pragma once: the build and install copy this header to
// stepguard/vocabulary.h for the public headers, and the two copies must count as one.
#ifndef STEPGUARD_CORE_VOCABULARY_H_
#define STEPGUARD_CORE_VOCABULARY_H_

#include <cstdint>
#include <optional>
#include <string_view>

namespace stepguard {

/// What became of one guarded step.
enum class Outcome : std::uint8_t {
  kApplied,     ///< the wrapped optimizer stepped
  kSkipped,     ///< the batch was dropped: no parameter or optimizer state changed
  kRolledBack,  ///< state was restored from a snapshot
  kAborted,     ///< the policy stopped training; further steps are refused
};

/// One thing the guard did on a step. A step may carry several (e.g. skip_batch + alert).
enum class Action : std::uint8_t {
  kApply,
  kSkipBatch,
  kClip,
  kDropLossScale,
  kLowerLr,
  kRollback,
  kAbort,
  kAlert,
  kResetMoments,  ///< zero the optimizer's moments of the affected tensors after the step (SPAM)
};

/// A condition the detectors raised on the agreed global statistics.
enum class Signal : std::uint8_t {
  kNonfiniteGrad,      ///< some gradient element is NaN or +/-Inf on some rank
  kNonfiniteLoss,      ///< the loss is NaN or +/-Inf on some rank
  kConsecutiveLimit,   ///< too many bad steps in a row: the skip budget is spent
  kRankDesync,         ///< some rank's guard state differs from the others': replicas diverged
  kLossSpike,          ///< the loss is more than z EMA standard deviations above its EMA mean
  kGradNormSpike,      ///< the grad norm is more than z EMA standard deviations above its mean
  kLossRatio,          ///< the loss exceeds k x the largest loss of the first N steps (Megatron)
  kSkipBudget,         ///< limits.max_skips: too many skipped steps within a window
  kRollbackBudget,     ///< limits.max_rollbacks: too many rollbacks within a window
  kLossScaleFloor,     ///< limits.loss_scale_floor: the loss scale sat at its floor too long
  kReplicaDivergence,  ///< some rank's parameters differ from the majority's (replica check)
  /// Gradients overflowed under loss scaling while the scale can still come down (finite loss,
  /// Inf in the gradients): the scaler's business, raised instead of kNonfiniteGrad.
  kOverflow,
  /// After a loss spike, the loss did not come back near its level from before the spike within
  /// the detector's window (detectors.loss_recovery): the divergence was not contained.
  kLossNotRecovered,
  /// The loss rose smoothly over its own earlier level, for longer than a step change rises
  /// (detectors.loss_trend): a divergence no spike test sees.
  kLossTrend,
  /// Training stopped moving: the grad norm exactly 0, the learning rate 0 or the loss the same
  /// to the last bit, step after step (detectors.stall).
  kStall,
  /// One rank's loss stood out from the others' for several steps in a row
  /// (detectors.rank_loss_shift): that rank's data or its shard of the model.
  kRankLossShift,
  /// The optimizer state holds NaN/Inf, or a negative second moment, before the update that
  /// would write it into the weights (detectors.optimizer_state).
  kOptimizerState,
};

/// The root causes forensics assigns to an incident, in the order they are checked.
enum class Cause : std::uint8_t {
  kData,               ///< the batch held NaN/Inf or empty sequences
  kForward,            ///< the forward pass (or the weights) made the first non-finite value
  kBackward,           ///< the forward was finite; backward made the first non-finite value
  kPrecisionOverflow,  ///< fp16/bf16 range: the same batch is finite in fp32
  kDivergence,         ///< finite but exploding: loss or grad norm ran away (LR, data)
  kHardwareSuspect,    ///< the same batch from the same state replays finite
  kOptimizerState,     ///< the optimizer state itself was bad before the update (the state check)
  kUnknown,
};

/// How a replay closure should recompute the offending batch (GuardedOptimizer::set_replay()).
enum class ReplayMode : std::uint8_t {
  kAsIs,     ///< exactly as the training step did (same precision, same loss scale)
  kFp32,     ///< in fp32: no loss scaling, no reduced-precision storage of gradients
  kAnomaly,  ///< as is; the guard runs it under autograd anomaly mode
};

namespace vocabulary_detail {
template <typename E>
struct Entry {
  E value;
  std::string_view name;
};
// One table per enum, in declaration order: the only place the names are spelled.
inline constexpr Entry<Outcome> kOutcomes[] = {{Outcome::kApplied, "applied"},
                                               {Outcome::kSkipped, "skipped"},
                                               {Outcome::kRolledBack, "rolled_back"},
                                               {Outcome::kAborted, "aborted"}};
inline constexpr Entry<Action> kActions[] = {{Action::kApply, "apply"},
                                             {Action::kSkipBatch, "skip_batch"},
                                             {Action::kClip, "clip"},
                                             {Action::kDropLossScale, "drop_loss_scale"},
                                             {Action::kLowerLr, "lower_lr"},
                                             {Action::kRollback, "rollback"},
                                             {Action::kAbort, "abort"},
                                             {Action::kAlert, "alert"},
                                             {Action::kResetMoments, "reset_moments"}};
inline constexpr Entry<Signal> kSignals[] = {{Signal::kNonfiniteGrad, "nonfinite_grad"},
                                             {Signal::kNonfiniteLoss, "nonfinite_loss"},
                                             {Signal::kConsecutiveLimit, "consecutive_limit"},
                                             {Signal::kRankDesync, "rank_desync"},
                                             {Signal::kLossSpike, "loss_spike"},
                                             {Signal::kGradNormSpike, "grad_norm_spike"},
                                             {Signal::kLossRatio, "loss_ratio"},
                                             {Signal::kSkipBudget, "skip_budget"},
                                             {Signal::kRollbackBudget, "rollback_budget"},
                                             {Signal::kLossScaleFloor, "loss_scale_floor"},
                                             {Signal::kReplicaDivergence, "replica_divergence"},
                                             {Signal::kOverflow, "overflow"},
                                             {Signal::kLossNotRecovered, "loss_not_recovered"},
                                             {Signal::kLossTrend, "loss_trend"},
                                             {Signal::kStall, "stall"},
                                             {Signal::kRankLossShift, "rank_loss_shift"},
                                             {Signal::kOptimizerState, "optimizer_state"}};
inline constexpr Entry<ReplayMode> kReplayModes[] = {
    {ReplayMode::kAsIs, "as_is"}, {ReplayMode::kFp32, "fp32"}, {ReplayMode::kAnomaly, "anomaly"}};
inline constexpr Entry<Cause> kCauses[] = {{Cause::kData, "data"},
                                           {Cause::kForward, "forward"},
                                           {Cause::kBackward, "backward"},
                                           {Cause::kPrecisionOverflow, "precision_overflow"},
                                           {Cause::kDivergence, "divergence"},
                                           {Cause::kHardwareSuspect, "hardware_suspect"},
                                           {Cause::kOptimizerState, "optimizer_state"},
                                           {Cause::kUnknown, "unknown"}};

template <typename E, std::size_t N>
constexpr const char* name_in(const Entry<E> (&table)[N], E value) noexcept {
  for (const auto& e : table) {
    if (e.value == value) return e.name.data();
  }
  return "unknown";
}
template <typename E, std::size_t N>
constexpr std::optional<E> value_in(const Entry<E> (&table)[N], std::string_view name) noexcept {
  for (const auto& e : table) {
    if (e.name == name) return e.value;
  }
  return std::nullopt;
}
}  // namespace vocabulary_detail

/// Every value, in declaration order (label sets, name lookups, "did you mean").
inline constexpr Outcome kAllOutcomes[] = {Outcome::kApplied, Outcome::kSkipped,
                                           Outcome::kRolledBack, Outcome::kAborted};
inline constexpr Action kAllActions[] = {
    Action::kApply,    Action::kSkipBatch, Action::kClip,  Action::kDropLossScale, Action::kLowerLr,
    Action::kRollback, Action::kAbort,     Action::kAlert, Action::kResetMoments};
inline constexpr Signal kAllSignals[] = {
    Signal::kNonfiniteGrad,    Signal::kNonfiniteLoss,     Signal::kConsecutiveLimit,
    Signal::kRankDesync,       Signal::kLossSpike,         Signal::kGradNormSpike,
    Signal::kLossRatio,        Signal::kSkipBudget,        Signal::kRollbackBudget,
    Signal::kLossScaleFloor,   Signal::kReplicaDivergence, Signal::kOverflow,
    Signal::kLossNotRecovered, Signal::kLossTrend,         Signal::kStall,
    Signal::kRankLossShift,    Signal::kOptimizerState};
inline constexpr Cause kAllCauses[] = {
    Cause::kData,       Cause::kForward,         Cause::kBackward,       Cause::kPrecisionOverflow,
    Cause::kDivergence, Cause::kHardwareSuspect, Cause::kOptimizerState, Cause::kUnknown};

/// Stable, lowercase names used in traces, JSON and metric labels.
constexpr const char* to_string(Outcome o) noexcept {
  return vocabulary_detail::name_in(vocabulary_detail::kOutcomes, o);
}
constexpr const char* to_string(Action a) noexcept {
  return vocabulary_detail::name_in(vocabulary_detail::kActions, a);
}
constexpr const char* to_string(Signal s) noexcept {
  return vocabulary_detail::name_in(vocabulary_detail::kSignals, s);
}
constexpr const char* to_string(ReplayMode m) noexcept {
  return vocabulary_detail::name_in(vocabulary_detail::kReplayModes, m);
}
constexpr const char* to_string(Cause c) noexcept {
  return vocabulary_detail::name_in(vocabulary_detail::kCauses, c);
}

/// The value a name spells, or nothing for a name that is not in the table.
constexpr std::optional<Outcome> parse_outcome(std::string_view name) noexcept {
  return vocabulary_detail::value_in(vocabulary_detail::kOutcomes, name);
}
constexpr std::optional<Action> parse_action(std::string_view name) noexcept {
  return vocabulary_detail::value_in(vocabulary_detail::kActions, name);
}
constexpr std::optional<Signal> parse_signal(std::string_view name) noexcept {
  return vocabulary_detail::value_in(vocabulary_detail::kSignals, name);
}
constexpr std::optional<Cause> parse_cause(std::string_view name) noexcept {
  return vocabulary_detail::value_in(vocabulary_detail::kCauses, name);
}

}  // namespace stepguard

#endif  // STEPGUARD_CORE_VOCABULARY_H_
