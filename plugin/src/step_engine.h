/*
 * StepEngine: one guarded step for any optimizer behind an OptimizerPort, as DESIGN.md draws it:
 *
 *   inspect  one fused pass over the gradients into the step buffer    (csrc/inspect)
 *   agree    ONE all-reduce of the buffer, one read to the host         (csrc/consensus)
 *   decide   detectors, policy, knobs, rollback target                  (step_controller)
 *   act      apply, skip, roll back, snapshot, checkpoint               (recovery)
 *   record   report, incident, trace, metrics                           (step_record.cpp)
 *
 * Each stage is a short call into the module that owns it. The LibTorch GuardedOptimizer and the
 * Python package are its two front ends; their documentation is the user's. Internal to the
 * engine (not installed). Not thread-safe: one training thread drives one engine.
 *
 * Background work: the RAM snapshot taken at the end of a step is copied while the training loop
 * runs its next forward and backward, and a disk checkpoint is written meanwhile too. The
 * contract with the loop: parameters and optimizer state change only inside step() (zero_grad,
 * forward and backward touch neither), so the copy is waited for at the start of the next step(),
 * before anything there can change them; a loop that changes them in place between steps (loading
 * a state dict, weight surgery) calls wait_for_background_work() first. Everything that reads or
 * restores snapshots (rollback, resume, stats(), the guard's record) waits for the copy first, and
 * a copy that failed is reported then, as a failure to take the snapshot.
 */
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "csrc/consensus/consensus.h"
#include "csrc/consensus/step_buffer.h"
#include "csrc/forensics/classifier.h"
#include "csrc/forensics/incident_report.h"
#include "csrc/forensics/input_check.h"
#include "csrc/forensics/probes.h"
#include "csrc/forensics/replays.h"
#include "csrc/inspect/counted_once.h"
#include "csrc/telemetry/event_log.h"
#include "csrc/telemetry/metrics.h"
#include "plugin/src/engine_config.h"
#include "plugin/src/layout.h"
#include "plugin/src/optimizer_port.h"
#include "plugin/src/recovery.h"
#include "plugin/src/state_check.h"
#include "plugin/src/step_controller.h"
#include "stepguard/guard_stats.h"
#include "stepguard/input_verdict.h"
#include "stepguard/options.h"
#include "stepguard/types.h"

namespace stepguard {

class StepEngine {
 public:
  /// Drives `port`, which must outlive the engine. Throws c10::Error naming the option or file
  /// when `options` are bad, the policy does not parse, the trace cannot be opened or the metrics
  /// port cannot be served.
  StepEngine(OptimizerPort& port, GuardOptions options);
  /// Waits for the snapshot copy and the checkpoint write in flight.
  ~StepEngine();
  StepEngine(const StepEngine&) = delete;
  StepEngine& operator=(const StepEngine&) = delete;

  /// One guarded step: verdict(loss), then the port's update when the verdict applies (the
  /// policy's clip, the LR factor), then settle(). An undefined `loss` guards on the gradients
  /// alone: the loss detectors see no value this step (StepReport::loss_given is false).
  StepReport step(const at::Tensor& loss);

  /// The step's two phases, for a framework that runs its own update between them:
  ///   verdict(loss)   inspect, agree (the step's one collective), decide, investigate. Changes
  ///                   no parameter and no optimizer state (an in-place unscale of the gradients
  ///                   under the guard's loss scaling aside); the step counter moves on.
  ///   the update      the framework's own, only when verdict.applies(), with every learning
  ///                   rate times verdict.lr_factor and its clip given verdict.grad_norm as the
  ///                   total norm (and verdict.clip_norm, the policy's clip, if set). Nothing of
  ///                   the guard's may be called in between but the read-only stats().
  ///   settle(v, applied)  restore (rollback), drop the gradients (skip), abort, snapshot,
  ///                   checkpoint, record, report. `applied`: whether the update ran; an update the
  ///                   verdict allowed that did not run (the framework's own overflow check, an
  ///                   exception in it: settle(v, false)) is recorded as a skipped step.
  /// verdict() while a verdict waits for its settle(), settle() without one, with another
  /// step's verdict or another guard's: c10::Error saying so, changing nothing. Between the two
  /// phases only stats() may run: the state dict, the data position, a checkpoint commit and a
  /// load or resume are refused the same way.
  Verdict verdict(const at::Tensor& loss);
  StepReport settle(const Verdict& verdict, bool applied);
  /// The policy's clip of this verdict (Action::kClip), on the port's gradients: one factor for
  /// every gradient, so the global norm becomes verdict.clip_norm. Nothing otherwise.
  void clip_gradients(const Verdict& verdict);
  /// Whether a verdict waits for its settle().
  bool verdict_pending() const noexcept { return pending_.has_value(); }

  /// The deferred verdict (GuardedOptimizer(deferred=True), for optimizers that take a device
  /// `found_inf`): begin_deferred(loss) inspects and sums the step buffer with no read and no
  /// host wait, and hands back `found_inf`, 1.0f on the device when the update must not run (a
  /// NaN/Inf gradient or loss on any rank, a bad optimizer state), and the LR factor decided so
  /// far; the buffer goes to the host in the background. The caller steps its optimizer with
  /// them. resolve_deferred() (at the next step, before its begin_deferred(), or to flush) waits
  /// for that copy and decides the step as settle() would: skips and aborts stand as the device
  /// made them, rollbacks restore the snapshot then (the batch of the call that resolves is
  /// dropped: its gradients are of the abandoned weights), a clip or a skip of a finite step
  /// comes too late and is recorded so. `update_failed`: the optimizer's step raised.
  /// `batch_in_hand`: a next step's batch is in hand (its backward ran on the weights a rollback
  /// abandons: it is dropped and counted as skipped data); false to flush between steps.
  struct DeferredBegin {
    at::Tensor found_inf;
    double lr_factor = 1.0;
  };
  DeferredBegin begin_deferred(const at::Tensor& loss);
  std::optional<StepReport> resolve_deferred(bool update_failed = false,
                                             bool batch_in_hand = false);
  bool deferred_pending() const noexcept { return deferred_ != nullptr; }
  /// While a deferred step waits for its decision: its agreed gradient norm on the device, no
  /// read (StepBuffer::norm_on_device()), for a framework's clip and log; throws otherwise.
  at::Tensor deferred_grad_norm() const;

  /// Waits for the background work of the last step: the snapshot copy (a failure is reported
  /// as one to take it) and this rank's checkpoint write (a failure is logged and counted).
  void wait_for_background_work();
  at::Tensor scale_loss(const at::Tensor& loss) const;
  InputVerdict check_inputs(const std::vector<at::Tensor>& inputs, const at::Tensor& mask);
  void set_replay(forensics::Recompute recompute);
  at::Tensor probe(const std::string& name, const at::Tensor& output);
  /// One of this rank's gradients before the framework reduces it (a tensor hook calls this;
  /// device ops, no read): a NaN/Inf there names this rank as the origin of a non-finite step,
  /// even where another rank's partition holds the reduced gradient (ZeRO 1/2).
  void watch_gradient(const at::Tensor& grad);
  void track_buffers(std::vector<at::Tensor> buffers) {
    recovery_.track_buffers(std::move(buffers));
  }
  std::int64_t resume(const std::string& dir);
  void set_data_position(std::int64_t position);
  void commit_pending_checkpoint();

  /// The guard's side of a checkpoint (step, data position, decision state, totals, skipped
  /// ranges), and its restore (a state dict of a front end). restore_record() checks it all
  /// first; c10::Error, changing nothing, when it does not fit this guard's policy.
  checkpoint::GuardRecord record() const {
    check_not_pending("taking the guard's state (state_dict())");
    return guard_record(step_);
  }
  void load_record(const checkpoint::GuardRecord& record);

  /// What the guard knows now (after the snapshot in flight has landed or failed).
  GuardStats stats();
  std::string metrics_text() const { return metrics_ ? metrics_->serialize() : std::string(); }
  /// The active policy's ladder in plain words (`stepguard policy explain`'s text; options that
  /// make a policy, such as max_consecutive_bad_steps, included), as /policy serves it.
  std::string explain_policy() const;
  OptimizerPort& port() noexcept { return port_; }

 private:
  /// What inspection and agreement produced for one step.
  struct Agreed {
    GlobalStats global;
    LocalStats local;
    inspect::DeferredBlame blame;
    at::Tensor rank_row;  ///< this rank's row of the step buffer, for a later gather
    double inspect_seconds = 0.0;
    double agree_seconds = 0.0;
  };
  /// What forensics made of an incident on this rank.
  struct Findings {
    std::vector<std::string> blamed;  ///< offending gradients, backward order
    forensics::Evidence evidence;
    forensics::Diagnosis diagnosis;  ///< this rank's own, when it is an origin rank
    bool origin = true;              ///< the fault came from this rank (or from no rank's own)
    std::vector<int> origin_ranks;
    std::vector<RankCause> rank_causes;  ///< agreed across ranks
    Cause agreed_cause = Cause::kUnknown;
  };

  /// What verdict() hands settle(): the step as inspected, agreed and decided.
  struct Pending {
    Agreed agreed;
    StepDecision decided;
    Findings findings;
  };
  struct DeferredStep;  // step_deferred.cpp

  void check_can_step(const at::Tensor& loss);
  /// The stage clock reset, the last snapshot landed, the step's checks; returns when the
  /// inspection's time starts.
  std::chrono::steady_clock::time_point begin_step(
      const at::Tensor& loss, std::optional<OptimizerPort::FrameworkLossScale> framework_scale);
  /// The framework's scale and floor for the step: from the step buffer where the port gave
  /// device tensors (checked then), else the port's host numbers into `global`.
  void agree_framework_scale(GlobalStats* global);
  /// enabled(false): the step as without the guard (counted; no inspection, collective or read).
  Verdict unguarded_verdict();
  StepReport unguarded_report(bool applied);
  void check_not_pending(const char* what) const;
  void refresh_layout();
  void parameters_changed();
  bool same_parameters() const;
  std::optional<at::Device> gradient_device() const;
  Agreed inspect_and_agree(const at::Tensor& loss, std::int64_t step);
  /// Inspection and the evidence into a fresh step buffer (everything before the collective).
  consensus::StepBuffer& inspect_and_pack(const at::Tensor& loss, std::int64_t step, Agreed* a);
  /// The summed buffer's host copy into a->global (and the rare per-rank exchange).
  void agree_counts(const at::Tensor& host, const at::Tensor& rank_row, std::int64_t step,
                    bool state_checked, Agreed* a);
  /// Runs `exchange`; when it throws, training is aborted (the ranks can no longer agree).
  void agree_or_abort(const std::function<void()>& exchange);
  /// 3 decide and the forensics of an incident, on the agreed statistics.
  void decide_and_investigate(std::int64_t step, Pending* p);
  StepDecision decide(std::int64_t step, const GlobalStats& global);
  Findings investigate(const Agreed& agreed, const StepDecision& decided);
  void state_evidence(const Signals& signals, Findings* f);
  void point_to_origin(const GlobalStats& g, Findings* f);
  /// On a loss-spike step under data parallelism: one more collective gives every rank every
  /// rank's loss, and the ranks whose loss rose become the origin ranks.
  void name_spike_ranks(Agreed* agreed, const StepDecision& decided);
  /// gather_rank_rows() of `row` for this step; aborts training when the collective fails.
  std::vector<double> gather_or_abort(const at::Tensor& row);
  /// On a replica-divergence step: the tensors whose bits differ on the diverged replicas.
  std::vector<std::string> diverged_tensor_names(const GlobalStats& g);
  std::vector<std::string> blame_across_ranks(const std::vector<std::string>& mine,
                                              std::int64_t step);
  /// `blamed`: the step's offending gradients on this rank (reset_moments' affected tensors).
  /// `gradients_current`: the port's gradients are this step's (false when the decision comes
  /// one step late: a skip then leaves the next step's gradients alone).
  void act(std::int64_t step, const GlobalStats& global, const StepDecision& decided,
           const std::vector<std::string>& blamed, bool gradients_current = true);
  /// `late`: the decision was made after the update ran or was skipped on the device.
  static void overrule(StepDecision* decided, bool applied, std::int64_t step, bool late = false);
  void checkpoint_after(std::int64_t step, const StepDecision& decided, const GlobalStats& global);
  /// Waits for the snapshot copy in flight; a copy that failed is reported (log, metric, book)
  /// as a snapshot that could not be taken. Never throws.
  void settle_snapshot() noexcept;
  /// After a load or resume: the state loaded, held as the snapshot of its step.
  void snapshot_loaded_state();
  void snapshot_failed(std::int64_t step, const char* why);
  /// Exports a checkpoint Recovery wrote, failed or skipped to the metrics.
  void export_checkpoint_event(const CheckpointEvent& event);
  StepReport record(std::int64_t step, const Agreed& agreed, const StepDecision& decided,
                    const Findings& findings);
  std::optional<Incident> make_incident(std::int64_t step, const Agreed& agreed,
                                        const StepDecision& decided, const Findings& findings,
                                        const StepReport& report);
  std::string write_incident_files(std::int64_t step, nlohmann::json& report_json);
  void run_replays(forensics::Evidence* ev);
  void agree_causes(std::int64_t step, const GlobalStats& global, Findings* f);
  bool replica_check_due(std::int64_t step) const;
  void abort_with(const std::string& reason);
  checkpoint::GuardRecord guard_record(std::int64_t at_step) const;
  void check_record(const checkpoint::GuardRecord& record) const;
  void restore_record(const checkpoint::GuardRecord& record);

  OptimizerPort& port_;
  /// This guard's number, unique in the process: its verdicts carry it.
  const std::uint64_t id_ = [] {
    static std::atomic<std::uint64_t> last{0};
    return ++last;
  }();
  GuardOptions options_;
  EngineConfig config_;  // first: it validates the options the members below are built from
  std::unique_ptr<consensus::Consensus> consensus_;
  StepController controller_;
  Recovery recovery_;
  std::unique_ptr<telemetry::EventLog> event_log_;
  std::unique_ptr<telemetry::Metrics> metrics_;

  /// This rank's gradients' copy counts (the port's layout), and whether every rank holds
  /// replicas only (agreed at construction).
  ResolvedLayout layout_;
  bool job_replicated_ = true;
  bool reduced_into_shards_ = false;  ///< the port's gradients_reduced_into_shards()
  std::int64_t restored_from_ = 0;    ///< the last step rolled back to this snapshot (0: did not)
  std::optional<Pending> pending_;
  std::optional<consensus::StepBuffer> step_buffer_;  ///< kept across steps (inspect_and_pack)
  std::unique_ptr<DeferredStep> deferred_;            ///< begun, its decision not yet made
  at::Tensor deferred_host_;         ///< the deferred step buffer's host copy (pinned)
  bool resolving_deferred_ = false;  ///< in resolve_deferred(): reports say `deferred`

  std::int64_t step_ = 0;
  GuardTotals totals_;
  StageSeconds stage_seconds_;  ///< of the last step, filled as step() runs the stages
  bool aborted_ = false;
  std::string abort_reason_;
  std::int64_t data_position_ = 0;
  std::vector<std::pair<std::int64_t, std::int64_t>> skipped_ranges_;
  /// Where this step's buffers live: the loss's device, else the gradients'.
  std::optional<at::Device> step_device_;
  std::int64_t last_snapshot_step_ = -1;  ///< the replica-check schedule follows it
  bool snapshot_loaded_ = false;          ///< a guard state was loaded: snapshot at the next step
  std::int64_t last_incident_step_ = -1;
  std::int64_t trace_failures_ = 0;  ///< trace lines that could not be written
  /// The port's parameters the snapshots were taken of, by identity: a group added or tensors
  /// swapped into a group (same count, other tensors) is another list.
  std::vector<const void*> known_parameters_;

  // Forensics.
  forensics::Recompute replay_;
  bool replaying_ = false;
  /// The agreed cause of a step in the current streak of non-finite steps was data, forward or
  /// backward (an fp32 replay reproduced it): the streak is not an fp16 overflow.
  bool overflow_ruled_out_ = false;
  /// The framework's loss scale at this step, when its scaler owns it (the port says).
  std::optional<OptimizerPort::FrameworkLossScale> framework_scale_;
  std::optional<double> replay_scale_;  ///< while replaying: scale_loss() uses the step's scale
  double step_loss_scale_ = 1.0;        ///< the scale this step's backward used
  /// The random streams before this step's forward pass (captured after the previous step and
  /// again by check_inputs()), so a replay draws the same dropout masks as the original.
  checkpoint::RngState forward_rng_;
  /// This step's check_inputs(), if it was called (its inputs are saved with a report).
  std::shared_ptr<const forensics::InputCheck> input_check_;
  forensics::Probes probes_;
  StateCheck state_check_;  ///< detectors.optimizer_state
  /// 0-d fp64 on the gradients' device: the sum of this step's watched gradients, NaN/Inf when
  /// one of them held NaN/Inf (undefined until watch_gradient() is first called).
  at::Tensor watched_grad_sum_;
  /// What probes saw during a forensic replay (the user's, and the module hooks the Python guard
  /// attaches for the replay when set_replay() was given the model).
  forensics::Probes replay_probes_;
  std::deque<forensics::HistoryRow> history_;  ///< the last kHistory steps, oldest first
  static constexpr std::size_t kHistory = 16;
};

/// "0, 3": ranks for a report's sentences (step_exchange.cpp).
std::string rank_list(const std::vector<int>& ranks);

}  // namespace stepguard
