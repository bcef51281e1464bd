/*
 * StepController: the decision half of a guarded step, shared by the guard and by `stepguard
 * replay`. It runs the policy engine on the agreed statistics and turns its decision into the
 * knobs' new values: the loss scale (GradScaler's rule plus the policy's drops) and the LR factor
 * (lowered by the policy, recovering on schedule). Torch-free, so a replay is the exact code path
 * of a live run.
 *
 * Internal to the plugin (not installed). Not thread-safe.
 */
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "csrc/policy/policy.h"
#include "csrc/scaling/loss_scaler.h"
#include "csrc/scaling/lr_controller.h"
#include "stepguard/types.h"

namespace stepguard {

/// What the controller decided for one step.
struct StepDecision {
  Signals signals;
  Decision decision;
  double loss_scale = 1.0;  ///< after this step's update (what the next backward uses)
  double lr_factor = 1.0;   ///< the factor this step's optimizer update used (or would have)
};

class StepController {
 public:
  /// `loss_scaling`: turn scaling on with GradScaler's defaults when the policy has no
  /// `loss_scale` section (a section decides by itself). Throws std::invalid_argument when the
  /// policy needs loss scaling (drop_loss_scale) and scaling is off.
  StepController(policy::PolicyConfig config, bool loss_scaling);

  /// Decides step `step` (1-based) from the agreed statistics and updates the loss scale and the
  /// LR factor.
  StepDecision decide(std::int64_t step, const GlobalStats& stats);

  bool loss_scaling() const noexcept { return scaler_.has_value(); }
  double loss_scale() const noexcept { return scaler_ ? scaler_->scale() : 1.0; }
  double inv_loss_scale() const noexcept { return scaler_ ? scaler_->inv_scale() : 1.0; }
  double loss_scale_floor() const noexcept { return scaler_ ? scaler_->config().min_scale : 0.0; }
  double lr_factor() const noexcept { return lr_.factor(); }
  const policy::PolicyConfig& config() const noexcept { return engine_.config(); }

  /// The policy engine's state (streaks, detectors, budgets).
  const policy::EngineState& engine_state() const noexcept { return engine_.state(); }
  /// Every decision-relevant value held here (engine, loss scaler, LR controller) as 64-bit
  /// words, and back: for snapshots and the cross-rank digest. decode() throws
  /// std::invalid_argument, changing nothing, when the words do not fit this policy.
  std::vector<std::int64_t> encode() const;
  void decode(const std::vector<std::int64_t>& words);
  /// After a rollback to a snapshot holding `words` (from encode()): the detectors, loss scale and
  /// LR factor come back from the snapshot, the rules' history stays, and the rolled-back step's
  /// own loss-scale and LR actions apply on top. Throws std::invalid_argument, changing nothing,
  /// when the words do not fit.
  void rollback_to(const std::vector<std::int64_t>& words, const Decision& decision);
  /// Back to the state of a new controller.
  void reset();
  /// FNV-1a over `step` and encode(), masked to 52 bits (exact in fp64).
  std::uint64_t digest(std::int64_t step) const;

 private:
  policy::PolicyConfig config_;
  bool loss_scaling_requested_;
  policy::PolicyEngine engine_;
  std::optional<scaling::LossScaler> scaler_;
  scaling::LrController lr_;
};

}  // namespace stepguard
