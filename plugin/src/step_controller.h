/*
 * StepController: the decision half of a guarded step, shared by the step engine and by
 * `stepguard replay`. It runs the policy engine on the agreed statistics, turns its decision into
 * the knobs' new values (the loss scale: GradScaler's rule plus the policy's drops; the LR factor:
 * lowered by the policy, recovering on schedule), keeps the book of RAM snapshots (cadence,
 * confirmation by the next clean step, the decision state each holds), and returns the final
 * decision: a rollback goes to the newest confirmed snapshot every rank can restore, or falls back
 * to a skip when there is none. make_report() builds the StepReport from it, live and in replay.
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

namespace stepguard {

/// The RAM snapshots as the decision sees them: the steps that hold one, whether the next step
/// confirmed it, and the decision state it holds. The live engine keeps the tensors beside it.
class SnapshotBook {
 public:
  struct Entry {
    std::int64_t step = 0;
    bool confirmed = false;
    std::vector<std::int64_t> words;  ///< StepController::encode() after that step
  };
  explicit SnapshotBook(const policy::CheckpointCadence& cadence) : cadence_(cadence) {}
  /// Whether a snapshot is due after `step` with `outcome`.
  bool due(std::int64_t step, Outcome outcome) const noexcept;
  void add(std::int64_t step, std::vector<std::int64_t> words);
  /// After every step: a clean step confirms the snapshot of the step before; a step with any
  /// signal discards it (the update that produced it is the suspect).
  void on_step(std::int64_t step, bool clean);
  /// Confirmed snapshots, newest first.
  std::vector<std::int64_t> confirmed_steps() const;
  const Entry* at(std::int64_t step) const;
  /// Steps held, oldest first.
  std::vector<std::int64_t> steps() const;
  void drop(std::int64_t step);
  void drop_newer_than(std::int64_t step);
  void clear() noexcept { entries_.clear(); }

 private:
  policy::CheckpointCadence cadence_;
  std::deque<Entry> entries_;  ///< oldest first
};

/// Given the confirmed snapshots (newest first), the step every rank restores, or 0 for none.
/// Live: checks the copies' checksums and agrees across ranks (it may throw to abort). Replay:
/// the newest.
using RollbackAgreement = std::function<std::int64_t(const std::vector<std::int64_t>&)>;

/// The agreement of a single process that holds every snapshot it booked (replay, tests): the
/// newest confirmed one.
std::int64_t newest_confirmed(const std::vector<std::int64_t>& confirmed);

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
  /// `loss_scale` section (a section decides by itself). Throws std::invalid_argument when the
  /// policy needs loss scaling (drop_loss_scale) and scaling is off.
  StepController(policy::PolicyConfig config, bool loss_scaling);

  /// Decides step `step` (1-based) from the agreed statistics, updates the loss scale and the LR
  /// factor, and settles a rollback: to the step `agree` returns (the knobs and detectors come
  /// back from its snapshot) or, when it returns 0, a skip instead.
  StepDecision decide(std::int64_t step, const GlobalStats& stats,
                      const RollbackAgreement& agree = newest_confirmed);
  /// After the step was acted on: whether a RAM snapshot is due now (then it is in the book).
  bool snapshot_due(std::int64_t step, Outcome outcome);

  bool loss_scaling() const noexcept { return scaler_.has_value(); }
  double loss_scale() const noexcept { return scaler_ ? scaler_->scale() : 1.0; }
  double inv_loss_scale() const noexcept { return scaler_ ? scaler_->inv_scale() : 1.0; }
  double loss_scale_floor() const noexcept { return scaler_ ? scaler_->config().min_scale : 0.0; }
  double lr_factor() const noexcept { return lr_.factor(); }
  const policy::PolicyConfig& config() const noexcept { return engine_.config(); }
  const SnapshotBook& snapshots() const noexcept { return book_; }
  SnapshotBook& snapshots() noexcept { return book_; }

  /// The policy engine's state (streaks, detectors, budgets).
  const policy::EngineState& engine_state() const noexcept { return engine_.state(); }
  /// Every decision-relevant value held here (engine, loss scaler, LR controller) as 64-bit
  /// words, and back: for snapshots and the cross-rank digest. decode() throws
  /// std::invalid_argument, changing nothing, when the words do not fit this policy.
  std::vector<std::int64_t> encode() const;
  void decode(const std::vector<std::int64_t>& words);
  /// Throws std::invalid_argument when `words` do not fit this policy or remember a step after
  /// `step` (the step they belong to); changes nothing.
  void check(const std::vector<std::int64_t>& words, std::int64_t step) const;
  /// Back to the decision state of a new controller (the snapshot book stays).
  void reset();
  /// FNV-1a over `step` and encode(), as 64 bits (the step buffer masks it).
  std::uint64_t digest(std::int64_t step) const;

 private:
  void update_knobs(const GlobalStats& stats, Decision* d);
  void settle_rollback(const RollbackAgreement& agree, StepDecision* out);
  /// After a rollback to a snapshot holding `words`: the detectors, loss scale and LR factor come
  /// back from the snapshot, the rules' history stays, and the rolled-back step's own loss-scale
  /// and LR actions apply on top.
  void rollback_to(const std::vector<std::int64_t>& words, const Decision& decision);

  policy::PolicyConfig config_;
  bool loss_scaling_requested_;
  policy::PolicyEngine engine_;
  std::optional<scaling::LossScaler> scaler_;
  scaling::LrController lr_;
  SnapshotBook book_;
};

/// The report of a decided step (without its incident): the one place a StepReport is built.
StepReport make_report(std::int64_t step, const GlobalStats& stats, const StepDecision& decided);

}  // namespace stepguard
