/*
 * The small value types the engine modules exchange: what one rank saw in its gradients
 * (LocalStats), what all ranks agreed on (GlobalStats), what the detectors raised (Signals),
 * what the policy decided (Decision) and what the guard tells the training loop (StepReport).
 *
 * This header depends on the standard library only. It is the one plugin header a csrc module
 * may include; modules talk to each other through these types and nothing else.
 */
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

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
};

/// A condition the detectors raised on the agreed global statistics.
enum class Signal : std::uint8_t {
  kNonfiniteGrad,     ///< some gradient element is NaN or +/-Inf on some rank
  kNonfiniteLoss,     ///< the loss is NaN or +/-Inf on some rank
  kConsecutiveLimit,  ///< too many bad steps in a row: the skip budget is spent
  kRankDesync,        ///< some rank's guard state differs from the others': replicas diverged
  kLossSpike,         ///< the loss is more than z EMA standard deviations above its EMA mean
  kGradNormSpike,     ///< the grad norm is more than z EMA standard deviations above its mean
  kLossRatio,         ///< the loss exceeds k x the largest loss of the first N steps (Megatron)
  kSkipBudget,        ///< limits.max_skips: too many skipped steps within a window
  kRollbackBudget,    ///< limits.max_rollbacks: too many rollbacks within a window
  kLossScaleFloor,    ///< limits.loss_scale_floor: the loss scale sat at its floor too long
};

/// Every signal, in declaration order (for label sets and name lookups).
constexpr Signal kAllSignals[] = {
    Signal::kNonfiniteGrad,  Signal::kNonfiniteLoss, Signal::kConsecutiveLimit, Signal::kRankDesync,
    Signal::kLossSpike,      Signal::kGradNormSpike, Signal::kLossRatio,        Signal::kSkipBudget,
    Signal::kRollbackBudget, Signal::kLossScaleFloor};

/// Stable, lowercase names used in traces, JSON and metrics labels.
constexpr const char* to_string(Outcome o) noexcept {
  switch (o) {
    case Outcome::kApplied:
      return "applied";
    case Outcome::kSkipped:
      return "skipped";
    case Outcome::kRolledBack:
      return "rolled_back";
    case Outcome::kAborted:
      return "aborted";
  }
  return "unknown";
}

constexpr const char* to_string(Action a) noexcept {
  switch (a) {
    case Action::kApply:
      return "apply";
    case Action::kSkipBatch:
      return "skip_batch";
    case Action::kClip:
      return "clip";
    case Action::kDropLossScale:
      return "drop_loss_scale";
    case Action::kLowerLr:
      return "lower_lr";
    case Action::kRollback:
      return "rollback";
    case Action::kAbort:
      return "abort";
    case Action::kAlert:
      return "alert";
  }
  return "unknown";
}

constexpr const char* to_string(Signal s) noexcept {
  switch (s) {
    case Signal::kNonfiniteGrad:
      return "nonfinite_grad";
    case Signal::kNonfiniteLoss:
      return "nonfinite_loss";
    case Signal::kConsecutiveLimit:
      return "consecutive_limit";
    case Signal::kRankDesync:
      return "rank_desync";
    case Signal::kLossSpike:
      return "loss_spike";
    case Signal::kGradNormSpike:
      return "grad_norm_spike";
    case Signal::kLossRatio:
      return "loss_ratio";
    case Signal::kSkipBudget:
      return "skip_budget";
    case Signal::kRollbackBudget:
      return "rollback_budget";
    case Signal::kLossScaleFloor:
      return "loss_scale_floor";
  }
  return "unknown";
}

/// Layout of the per-step buffer (fp64) that ONE sum all-reduce carries across ranks.
/// Counts are exact in fp64 up to 2^53. After the fixed slots come two blocks of world_size slots:
/// rank r writes 1 into its fault slot when it saw a non-finite gradient or loss, and its 52-bit
/// state digest into its digest slot; the others add 0 there, so after the sum every rank knows
/// which ranks were faulty and every rank's digest, exactly.
namespace stats_slot {
constexpr int kNanCount = 0;            ///< NaN gradient elements
constexpr int kInfCount = 1;            ///< +/-Inf gradient elements
constexpr int kSumSquares = 2;          ///< sum of squares of the finite gradient elements
constexpr int kSumSquaresOverflow = 3;  ///< ranks whose finite sum of squares overflowed fp64
constexpr int kLossSum = 4;             ///< sum of the finite local losses
constexpr int kLossNonfinite = 5;       ///< ranks whose loss is NaN/Inf
constexpr int kRanksReporting = 6;      ///< each rank adds 1: a check that every rank took part
constexpr int kFixed = 7;               ///< number of fixed slots
/// Rank r's fault flag.
constexpr int rank_fault(int rank) noexcept { return kFixed + rank; }
/// Rank r's state digest.
constexpr int rank_digest(int world_size, int rank) noexcept { return kFixed + world_size + rank; }
/// Length of the buffer for `world_size` ranks.
constexpr int size(int world_size) noexcept { return kFixed + 2 * world_size; }
/// Digests are masked to the integers fp64 holds exactly.
constexpr std::uint64_t kDigestMask = (std::uint64_t{1} << 52) - 1;
}  // namespace stats_slot

/// What one rank found in its own gradients. Produced by inspection (the loss goes into the step
/// buffer directly).
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
  double loss = 0.0;  ///< mean of the finite rank losses; NaN when every rank's loss is bad
  std::int64_t loss_nonfinite_ranks = 0;
  int world_size = 1;
  std::vector<int> faulty_ranks;    ///< ranks that saw a non-finite gradient or loss
  std::vector<int> desynced_ranks;  ///< ranks whose state digest differs from the majority

  std::int64_t nonfinite_count() const noexcept { return nan_count + inf_count; }
};

/// What the detectors raised on one step, plus the streak they track.
struct Signals {
  std::vector<Signal> raised;
  std::int64_t consecutive_bad_steps = 0;  ///< including this one when it is bad
  std::vector<int> desynced_ranks;         ///< with kRankDesync: the ranks that diverged

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

/// The root causes forensics assigns, as Incident::cause and the metric label spell them.
constexpr const char* kIncidentCauses[] = {
    "data",       "forward",          "backward", "precision_overflow",
    "divergence", "hardware_suspect", "unknown"};

/// One incident: a step where a detector fired and the policy acted.
struct Incident {
  std::int64_t step = 0;
  std::string signal;  ///< the first signal raised, e.g. "nonfinite_grad"
  std::string action;  ///< the strongest action taken, e.g. "skip_batch"
  /// Root-cause class: data, forward, backward, precision_overflow, divergence,
  /// hardware_suspect or unknown (this rank's view; see forensics in the README).
  std::string cause = "unknown";
  std::vector<std::string> tensors;   ///< offending gradients on this rank, in backward order
  std::vector<int> ranks;             ///< ranks that saw the fault
  std::string reason;                 ///< the policy's: signals and the rules that fired
  std::vector<std::string> evidence;  ///< why the cause, one line each
  std::vector<std::string> fixes;     ///< what to try first
  std::string report;                 ///< path of the JSON incident report, when written
};

/// What guard.step(loss) returns to the training loop.
struct StepReport {
  Outcome outcome = Outcome::kApplied;
  std::int64_t step = 0;   ///< 1-based count of guarded steps, this one included
  double loss = 0.0;       ///< the agreed loss (mean over ranks)
  double grad_norm = 0.0;  ///< global L2 norm of the finite gradient elements
  double loss_scale = 1.0;
  double lr_factor = 1.0;
  std::int64_t nonfinite_count = 0;  ///< NaN/Inf gradient elements over all ranks
  std::vector<Action> actions;
  std::int64_t batches_to_skip = 0;  ///< batches the loop must drop before the next step
  /// With outcome kRolledBack: the step whose snapshot was restored. The loop continues from its
  /// current data position plus batches_to_skip (batches consumed since the snapshot are not
  /// replayed).
  std::int64_t rolled_back_to = 0;
  std::optional<Incident> incident;

  bool applied() const noexcept { return outcome == Outcome::kApplied; }
  bool aborted() const noexcept { return outcome == Outcome::kAborted; }
};

}  // namespace stepguard
