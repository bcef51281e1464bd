/*
 * Root-cause classification of an incident, in the order practitioners debug a NaN: was it real
 * (does it reproduce?), then the data, the weights and the forward pass, precision, the learning
 * rate, and finally the backward pass. Input is the evidence the guard gathered; output is a cause
 * from a fixed set, the evidence that decided it, and the fixes to try first.
 *
 * Torch-free and pure: the same evidence gives the same diagnosis. Thread-compatible.
 */
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/vocabulary.h"

namespace stepguard {
namespace forensics {

/// A weight above this magnitude is named when the loss turns non-finite: no trained weight is
/// near it, and one such value overflows the activations it multiplies.
constexpr double kHugeWeight = 1e8;

/// What a replay of the offending batch showed.
enum class ReplayResult : std::uint8_t {
  kNotRun,      ///< no replay closure, or not applicable
  kReproduced,  ///< the replay was non-finite again
  kVanished,    ///< the replay was finite
};

struct Evidence {
  // The step itself (agreed across ranks).
  bool loss_nonfinite = false;
  bool grads_nonfinite = false;
  std::int64_t nan_count = 0;
  std::int64_t inf_count = 0;
  bool loss_spike = false;       ///< the loss-spike or loss-ratio detector fired
  bool grad_norm_spike = false;  ///< the grad-norm detector fired
  double loss_level = 0.0;       ///< with loss_spike or loss_not_recovered: the level before
  /// With loss_spike under data parallelism: the ranks whose own loss rose, when not all did.
  std::vector<int> spike_ranks;
  std::vector<double> rank_losses;  ///< every rank's loss, when the ranks were named
  double rank_loss = 0.0;           ///< this rank's own loss (0 when unknown)
  /// The step before this one rolled back: the weights are those of this snapshot (its step;
  /// 0 otherwise), restored and not yet updated.
  std::int64_t restored_from = 0;
  // The recovery watch after a spike (detectors.loss_recovery) raised loss_not_recovered.
  bool loss_not_recovered = false;
  std::int64_t diverging_steps = 0;  ///< steps since the spike that began the watch
  double grad_norm_level = 0.0;      ///< the grad norm's level before that spike
  std::int64_t escalations = 0;      ///< times loss_not_recovered was raised in this watch
  // Trend detectors (csrc/policy/trend.h) that raised on this step: what each saw, and the
  // cause and first fixes of the first one's kind (when nothing before it in the debugging
  // order explains the step).
  std::vector<std::string> trend_findings;
  Cause trend_cause = Cause::kUnknown;
  std::vector<std::string> trend_fixes;
  /// The optimizer state check found bad elements before the update (detectors.optimizer_state;
  /// empty when it did not): the finding first, then the state tensors that hold them. Checked
  /// before anything else: the state was looked at, and the update would have written it into
  /// the weights.
  std::vector<std::string> state_findings;
  std::vector<std::string> state_fixes;
  // Data (from check_inputs on this rank).
  bool inputs_checked = false;          ///< check_inputs() was called for this step
  std::vector<std::string> bad_inputs;  ///< e.g. "input 0: 64 NaN/Inf values"
  // Replica check: this rank's parameters differ from the majority of the replicas'.
  bool diverged_replica = false;
  /// The tensors whose values differ between the replicas (the replica check's per-tensor
  /// fingerprints), whatever else the step's gradients hold.
  std::vector<std::string> diverged_tensors;
  // Weights (this rank, before the step).
  std::vector<std::string> nonfinite_params;
  /// Finite parameters holding a value above kHugeWeight in magnitude, "name (largest x)".
  std::vector<std::string> huge_params;
  /// This rank's own gradients held NaN/Inf before the framework reduced them (the gradient
  /// watch, watch_gradient()).
  bool grads_bad_before_reduction = false;
  // Gradients holding NaN/Inf on this rank, in backward order (last layer first).
  std::vector<std::string> blamed_grads;
  // Precision.
  bool loss_scaling = false;
  double loss_scale = 1.0;
  bool loss_scale_at_floor = false;  ///< the scale cannot back off any further
  /// An fp32 replay earlier in this streak of non-finite steps reproduced it: not an overflow.
  bool overflow_ruled_out = false;
  // History of agreed values before this step, oldest first.
  std::vector<double> recent_grad_norms;
  std::vector<double> recent_losses;
  double grad_norm = 0.0;  ///< this step's (finite elements)
  double loss = 0.0;
  // Replays (optional, given a closure that recomputes the loss).
  ReplayResult rerun = ReplayResult::kNotRun;  ///< the batch again, as is
  ReplayResult fp32 = ReplayResult::kNotRun;   ///< the batch again in fp32
  std::string anomaly_op;  ///< the op anomaly mode named for the first NaN in backward
  std::string anomaly_message;
  /// What anomaly mode said while replaying (its warnings: the forward traceback of the op that
  /// produced the first NaN), captured instead of printed; at most a few KB.
  std::string anomaly_traceback;
  // Probes (optional): the first probed output that was non-finite in forward (call order), and
  // the first probed output whose gradient was non-finite (backward order).
  std::string first_bad_forward;
  std::string first_bad_backward;
};

struct Diagnosis {
  Cause cause = Cause::kUnknown;
  std::vector<std::string> evidence;  ///< why, one line each, in the order checked
  std::vector<std::string> fixes;     ///< what to try first
};

Diagnosis classify(const Evidence& e);

}  // namespace forensics
}  // namespace stepguard
