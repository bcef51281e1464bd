/*
 * StepController: the decision half of a guarded step, shared by the step engine and by
 * `stepguard replay`. It runs the policy engine on the agreed statistics, turns its decision into
 * the knobs' new values (the loss scale: GradScaler's rule plus the policy's drops; the LR factor:
 * lowered by the policy, recovering on schedule), and returns the final decision: a rollback goes
 * to the snapshot the holder of the RAM snapshots names (the newest confirmed one every rank can
 * restore; see snapshot_book.h), or falls back to a skip when there is none. make_report() builds
 * the StepReport from it, live and in replay.
 *
 * Torch-free, so a replay is the exact code path of a live run. Internal to the engine (not
 * installed). Not thread-safe.
 */
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <vector>

#include "csrc/core/report.h"
#include "csrc/core/stats.h"
#include "csrc/policy/policy.h"
#include "csrc/scaling/loss_scaler.h"
#include "csrc/scaling/lr_controller.h"
#include "plugin/src/snapshot_book.h"

namespace stepguard {

/// What the controller decided for one step.
struct StepDecision {
  Signals signals;
  Decision decision;
  double loss_scale = 1.0;  ///< after this step's update (what the next backward uses)
  double lr_factor = 1.0;   ///< the factor this step's optimizer update used (or would have)
  std::int64_t rolled_back_to = 0;  ///< with kRolledBack: the snapshot's step
};

class StepController {
 public:
  /// `loss_scaling`: turn scaling on with GradScaler's defaults when the policy has no
  /// `loss_scale` section (a section decides by itself). `framework_scale`: a framework's
  /// scaler (or none) owns the scale: no scaler of the guard's, whatever the section says, and
  /// `limits.loss_scale_floor` counts the steps in a row that overflowed at the framework's
  /// floor. Throws
  /// std::invalid_argument when the policy needs the guard's scaling (drop_loss_scale) and it
  /// is off.
  StepController(policy::PolicyConfig config, bool loss_scaling, bool framework_scale = false);

  /// Decides step `step` (1-based) from the agreed statistics, updates the loss scale and the LR
  /// factor, tells `snapshots` whether the step was clean, and settles a rollback: to the
  /// snapshot `snapshots` names (the knobs and detectors come back from it) or, when there is
  /// none (or no holder), a skip instead.
  StepDecision decide(std::int64_t step, const GlobalStats& stats,
                      SnapshotHolder* snapshots = nullptr);

  bool loss_scaling() const noexcept { return scaler_.has_value(); }
  double loss_scale() const noexcept { return scaler_ ? scaler_->scale() : 1.0; }
  double inv_loss_scale() const noexcept { return scaler_ ? scaler_->inv_scale() : 1.0; }
  double loss_scale_floor() const noexcept { return scaler_ ? scaler_->floor() : 0.0; }
  double lr_factor() const noexcept { return lr_.factor(); }
  const policy::PolicyConfig& config() const noexcept { return engine_.config(); }

  /// The policy engine's state (streaks, detectors, budgets).
  const policy::EngineState& engine_state() const noexcept { return engine_.state(); }
  /// Every decision-relevant value held here (engine, loss scaler, LR controller) as 64-bit
  /// words, and back: for snapshots and the cross-rank digest. decode() throws
  /// std::invalid_argument, changing nothing, when the words do not fit this policy; words saved
  /// under other rules restore with each rule's state fresh, said on stderr unless `quiet`.
  std::vector<std::int64_t> encode() const;
  void decode(const std::vector<std::int64_t>& words, bool quiet = false);
  /// Throws std::invalid_argument when `words` do not fit this policy or remember a step after
  /// `step` (the step they belong to); changes nothing.
  void check(const std::vector<std::int64_t>& words, std::int64_t step) const;
  /// Back to the decision state of a new controller.
  void reset();
  /// FNV-1a over `step` and encode(), as 64 bits (the step buffer masks it).
  std::uint64_t digest(std::int64_t step) const;

 private:
  void update_knobs(const GlobalStats& stats, Decision* d);
  void settle_rollback(std::int64_t step, bool replicas_diverged, SnapshotHolder* snapshots,
                       StepDecision* out);
  /// After a rollback at `step` to a snapshot holding `words`: the detectors, loss scale and LR
  /// factor come back from the snapshot (the LR factor not while a loss spike's recovery has been
  /// watched since an earlier step: its cuts stay), the rules' history stays, and the rolled-back
  /// step's own loss-scale and LR actions apply on top.
  void rollback_to(const std::vector<std::int64_t>& words, const Decision& decision,
                   std::int64_t step);

  policy::PolicyConfig config_;
  bool loss_scaling_requested_;
  bool framework_scale_;
  /// Consecutive steps that overflowed with the framework's scale at its floor
  /// (framework_scale_ only; not in encode(): a resume starts it from 0).
  std::int64_t framework_steps_at_floor_ = 0;
  policy::PolicyEngine engine_;
  std::optional<scaling::LossScaler> scaler_;
  scaling::LrController lr_;
};

/// The report of a decided step (without its incident): the one place a StepReport is built.
StepReport make_report(std::int64_t step, const GlobalStats& stats, const StepDecision& decided);

}  // namespace stepguard
