// StepEngine: the pipeline of one guarded step, in its two phases (verdict, settle). The record
// stage and forensics live in step_record.cpp, the guard's saved state in step_state.cpp.
#include "plugin/src/step_engine.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <limits>

#include "csrc/consensus/process_group_consensus.h"
#include "csrc/policy/policy_file.h"
#include "plugin/src/moment_reset.h"
#include "plugin/src/step_internal.h"

namespace stepguard {

namespace {

using Clock = EngineClock;

std::unique_ptr<consensus::Consensus> make_consensus(const GuardOptions& o) {
  if (!o.process_group()) return std::make_unique<consensus::LocalConsensus>();
  return std::make_unique<consensus::ProcessGroupConsensus>(o.process_group(),
                                                            o.collective_timeout(), o.store());
}

StepController make_controller(const EngineConfig& config) {
  try {
    return StepController(config.policy, config.loss_scaling, config.framework_scale);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
}

RecoveryConfig recovery_config(const GuardOptions& o, const EngineConfig& c) {
  RecoveryConfig r;
  r.snapshot_every = c.policy.checkpoint.snapshot_every;
  r.snapshot_keep = c.policy.checkpoint.snapshot_keep;
  r.checkpoint_dir = o.checkpoint_dir();
  r.disk_every = c.disk_every;
  r.disk_keep = static_cast<int>(c.policy.checkpoint.disk_keep);
  r.run_id = o.run_id();
  return r;
}

}  // namespace

StepEngine::StepEngine(OptimizerPort& port, GuardOptions options)
    : port_(port),
      options_(std::move(options)),
      config_(resolve_config(options_, port.owns_loss_scale())),
      consensus_(make_consensus(options_)),
      controller_(make_controller(config_)),
      recovery_(*consensus_, port_, recovery_config(options_, config_)) {
  const std::string explained = explain_policy();  // /policy's page, and the ranks' digest
  if (options_.enabled()) {  // a guard that is off serves no metrics and writes no trace
    metrics_ = open_metrics(options_, consensus_->rank(), controller_.loss_scale_floor(),
                            config_.disk_every, explained);
    event_log_ = open_trace(options_);
  }
  recovery_.on_checkpoint_event([this](const CheckpointEvent& e) { export_checkpoint_event(e); });
  for (const auto& p : port_.parameters()) known_parameters_.push_back(p.unsafeGetTensorImpl());
  refresh_layout();
  reduced_into_shards_ = port_.gradients_reduced_into_shards();
  // One collective at construction, on every rank: settings that differ and lists that cannot
  // fit together are refused here, naming every rank's, instead of being met later as a
  // mismatched collective or two ranks deciding differently.
  RankSettings settings;
  settings.policy_digest = text_digest(explained);
  settings.checkpoint_dir = !options_.checkpoint_dir().empty();
  settings.disk_every = config_.disk_every;
  settings.loss_scaling = controller_.loss_scaling();
  settings.sharded_gradients = options_.sharded_gradients();
  settings.enabled = options_.enabled();
  const auto& params = port_.parameters();
  job_replicated_ =
      reconcile_ranks(*consensus_, layout_, settings,
                      params.empty() ? at::Device(at::kCPU) : params.front().device());
}

StepEngine::~StepEngine() { wait_for_background_work(); }

StepReport StepEngine::step(const at::Tensor& loss) {
  const Verdict v = verdict(loss);
  bool applied = false;
  const auto t = Clock::now();
  if (v.applies()) {
    try {
      clip_gradients(v);
      port_.apply(v.lr_factor);
      applied = true;
    } catch (...) {
      // The update failed part way or not at all: the step is settled as not applied (counted,
      // recorded), and the error goes to the caller.
      (void)settle(v, false);
      throw;
    }
  }
  const double update_seconds = seconds_since(t);
  StepReport report = settle(v, applied);
  stage_seconds_.act += update_seconds;
  return report;
}

// What every step begins with: the stage clock, the last snapshot landed, the step's checks.
// Returns when inspection's time starts.
// `framework_scale`: the port's framework_loss_scale(), asked once per step by the caller.
EngineClock::time_point StepEngine::begin_step(
    const at::Tensor& loss, std::optional<OptimizerPort::FrameworkLossScale> framework_scale) {
  // Stage times for last_stage_seconds(): inspect counts the checks and the packing, record counts
  // forensics, and act leaves out the snapshot (timed here and in checkpoint_after).
  stage_seconds_ = StageSeconds{};
  auto t = Clock::now();
  // The snapshot copied while the loop ran forward and backward lands before anything below can
  // change what it reads (a rollback, the optimizer step, a restore).
  settle_snapshot();
  snapshot_loaded_state();
  stage_seconds_.snapshot = seconds_since(t);  // the wait for the last step's copy
  t = Clock::now();
  check_can_step(loss);
  framework_scale_ = std::move(framework_scale);
  TORCH_CHECK(!(framework_scale_ && controller_.loss_scaling()),
              "stepguard: the framework's own loss scaler is on, and so is the guard's "
              "(loss_scaling or a policy with a loss_scale section): one scaler owns the scale; "
              "leave the guard's off");
  return t;
}

// Each stage is a named range in torch.profiler traces (stepguard::verdict, ::inspect, ::agree,
// ::decide, ::forensics, ::settle, ::act, ::restore, ::snapshot, ::snapshot_wait, ::record),
// from Python, C++ and every framework integration alike; free when no profiler runs.
Verdict StepEngine::verdict(const at::Tensor& loss) {
  RECORD_USER_SCOPE("stepguard::verdict");
  check_not_pending("verdict()");
  if (!options_.enabled()) return unguarded_verdict();
  const auto t = begin_step(loss, port_.framework_loss_scale());
  const std::int64_t step = step_ + 1;
  Pending p;
  p.agreed = inspect_and_agree(loss, step);
  stage_seconds_.agree = p.agreed.agree_seconds;
  stage_seconds_.inspect = seconds_since(t) - p.agreed.agree_seconds;
  decide_and_investigate(step, &p);
  // The figures the report will carry, read off the same decision.
  const StepReport r = make_report(step, p.agreed.global, p.decided);
  Verdict v;
  v.step = step;
  v.outcome = r.outcome;
  v.actions = r.actions;
  v.action = r.action;
  v.grad_norm = r.grad_norm;
  v.clip_norm = p.decided.decision.has(Action::kClip) ? p.decided.decision.clip_norm : 0.0;
  v.loss_scale = step_loss_scale_;  // the backward's (the report's is the next step's)
  v.lr_factor = r.lr_factor;
  v.nonfinite_count = r.nonfinite_count;
  v.loss_given = r.loss_given;
  v.loss = r.loss;
  v.batches_to_skip = r.batches_to_skip;
  v.guard_id = id_;
  pending_ = std::move(p);
  return v;
}

void StepEngine::clip_gradients(const Verdict& v) {
  if (!v.applies() || v.clip_norm <= 0.0 || !(v.grad_norm > v.clip_norm)) return;
  // One factor for all (ZClip-style), one foreach multiply by a host scalar: no tensor made.
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (auto& g : port_.gradients()) {
    if (g.defined()) grads.push_back(g);
  }
  if (!grads.empty()) at::_foreach_mul_(grads, v.clip_norm / v.grad_norm);
}

StepReport StepEngine::settle(const Verdict& v, bool applied) {
  RECORD_USER_SCOPE("stepguard::settle");
  TORCH_CHECK(pending_.has_value(), "stepguard: settle() without a verdict: step ", step_,
              " is settled already; call verdict(loss) first");
  TORCH_CHECK(v.guard_id == id_, "stepguard: settle() was given a verdict of another guard (step ",
              v.step, "); each guard settles the verdicts it gave");
  TORCH_CHECK(v.step == step_, "stepguard: settle() was given the verdict of step ", v.step,
              "; the verdict waiting for its settle() is step ", step_);
  Pending p = std::move(*pending_);
  pending_.reset();
  if (!options_.enabled()) return unguarded_report(applied);
  overrule(&p.decided, applied, step_);
  const double settled = stage_seconds_.snapshot;  // verdict()'s wait for the last copy
  stage_seconds_.snapshot = 0.0;
  auto t = Clock::now();
  act(step_, p.agreed.global, p.decided, p.findings.blamed);
  stage_seconds_.act = seconds_since(t) - stage_seconds_.snapshot;
  stage_seconds_.snapshot += settled;
  t = Clock::now();
  StepReport report = record(step_, p.agreed, p.decided, p.findings);
  stage_seconds_.record += seconds_since(t);
  return report;
}

// What the framework did against the verdict: an allowed update that did not run is a skipped
// step; an update run against a skip is an applied one (said on stderr: it cannot be undone).
// A rollback restores and an abort ends training whatever the update did.
void StepEngine::overrule(StepDecision* decided, bool applied, std::int64_t step, bool late) {
  Decision& d = decided->decision;
  if (late && applied && d.has(Action::kClip)) {
    d.reason += std::string(d.reason.empty() ? "" : "; ") +
                "decided after the update ran (deferred verdict): not clipped";
  }
  if (d.outcome == Outcome::kApplied && !applied) {
    d.outcome = Outcome::kSkipped;
    if (!d.has(Action::kSkipBatch)) d.actions.push_back(Action::kSkipBatch);
    d.reason += std::string(d.reason.empty() ? "" : "; ") +
                "the framework did not apply the update the verdict allowed";
  } else if (d.outcome == Outcome::kSkipped && applied) {
    std::fprintf(stderr, "stepguard: step %" PRId64 ": %s (%s); counted as applied\n", step,
                 late ? "the deferred verdict skipped an update that had already run"
                      : "the framework applied an update the guard's verdict skipped",
                 d.reason.c_str());
    d.outcome = Outcome::kApplied;
    d.reason += std::string(d.reason.empty() ? "" : "; ") +
                (late ? "decided after the update ran (deferred verdict): applied"
                      : "the framework applied the update the verdict skipped");
  }
}

void StepEngine::check_not_pending(const char* what) const {
  TORCH_CHECK(!deferred_, "stepguard: ", what, " while step ", step_,
              " waits for its deferred decision; flush() it first (GuardedOptimizer.flush())");
  TORCH_CHECK(!pending_.has_value(), "stepguard: ", what, " while the verdict of step ", step_,
              " waits for its settle(); call settle(verdict, applied) first (settle(verdict, "
              "false) after an exception in the update)");
}

void StepEngine::check_can_step(const at::Tensor& loss) {
  TORCH_CHECK(!aborted_, "stepguard: training was aborted at step ", step_, " (", abort_reason_,
              "); step() refuses to run after an abort");
  port_.refresh();
  if (!same_parameters()) parameters_changed();
  recovery_.claim_checkpoint_dir(step_ + 1);
  step_device_ = gradient_device();
  if (!loss.defined()) return;  // step() from the gradients alone
  TORCH_CHECK(loss.layout() == at::kStrided, "stepguard: loss must be a dense tensor, got ",
              loss.layout());
  TORCH_CHECK(loss.numel() == 1, "stepguard: loss must be a scalar (one element), got shape ",
              loss.sizes());
  TORCH_CHECK(at::isFloatingType(loss.scalar_type()),
              "stepguard: loss must be a floating-point tensor, got ", loss.scalar_type());
  if (step_device_) {
    TORCH_CHECK(*step_device_ == loss.device(), "stepguard: loss is on ", loss.device(),
                " but the gradients are on ", *step_device_,
                "; loss and gradients must be on one device");
  }
  step_device_ = loss.device();
}

// Where this step's gradients live: the first defined gradient's device (none: no gradient yet).
// A parameter that is not a leaf (a port's view into flat storage, as DeepSpeed ZeRO's) has no
// .grad of its own (reading it makes autograd warn, once per parameter per step): its gradient
// is the port's, on the view's device.
std::optional<at::Device> StepEngine::gradient_device() const {
  std::optional<at::Device> view_device;
  for (const auto& p : port_.parameters()) {
    if (!p.is_leaf()) {
      if (!view_device) view_device = p.device();
      continue;
    }
    if (p.grad().defined()) return p.grad().device();
  }
  return view_device;
}

// 3 decide, and the forensics of an incident (the same on every rank up to each rank's evidence).
void StepEngine::decide_and_investigate(std::int64_t step, Pending* p) {
  auto t = Clock::now();
  GlobalStats& g = p->agreed.global;
  g.overflow_ruled_out = overflow_ruled_out_ && g.nonfinite();
  // The stall detector's: read only while a detector that uses it is on.
  g.largest_lr = policy::trends_read_lr(controller_.config().detectors.trends)
                     ? port_.largest_lr()
                     : std::numeric_limits<double>::quiet_NaN();
  if (framework_scale_) agree_framework_scale(&g);
  p->decided = decide(step, g);
  stage_seconds_.decide = seconds_since(t);
  t = Clock::now();
  name_spike_ranks(&p->agreed, p->decided);
  p->findings = investigate(p->agreed, p->decided);
  const Cause cause = p->findings.agreed_cause;
  overflow_ruled_out_ = g.nonfinite() && (g.overflow_ruled_out || cause == Cause::kData ||
                                          cause == Cause::kForward || cause == Cause::kBackward);
  stage_seconds_.record = seconds_since(t);
}

// 3 detect, 4 decide: the same on every rank (a function of the agreed stats and state).
StepDecision StepEngine::decide(std::int64_t step, const GlobalStats& global) {
  RECORD_USER_SCOPE("stepguard::decide");
  step_loss_scale_ = framework_scale_ ? framework_scale_->scale : controller_.loss_scale();
  try {
    // Recovery owns the snapshots: it confirms them and agrees on a rollback target.
    return controller_.decide(step, global, &recovery_);
  } catch (const RollbackFailure& e) {
    abort_with(e.what());
    TORCH_CHECK(false, "stepguard: step ", step, ": cannot roll back: ", e.what());
  } catch (const std::invalid_argument& e) {
    abort_with(e.what());
    TORCH_CHECK(false, "stepguard: step ", step, ": ", e.what());
  }
}

// 5 act: restore or drop the step (the update itself ran between the phases), then the snapshot
// and checkpoint cadence.
void StepEngine::act(std::int64_t step, const GlobalStats& global, const StepDecision& decided,
                     const std::vector<std::string>& blamed, bool gradients_current) {
  RECORD_USER_SCOPE("stepguard::act");
  const Decision& decision = decided.decision;
  switch (decision.outcome) {
    case Outcome::kApplied:
      ++totals_.applied;
      break;
    case Outcome::kSkipped:
      if (options_.zero_grad_on_skip() && gradients_current) port_.discard();
      ++totals_.skipped;
      break;
    case Outcome::kRolledBack:
      try {
        RECORD_USER_SCOPE("stepguard::restore");
        recovery_.restore_snapshot(decided.rolled_back_to);
      } catch (const std::exception& e) {
        // Every rank agreed to restore; one that cannot may not train on alone.
        abort_with(e.what());
        throw;
      }
      port_.discard();  // gradients of the abandoned state
      ++totals_.rolled_back;
      break;
    case Outcome::kAborted:
      if (options_.zero_grad_on_skip() && gradients_current) port_.discard();
      abort_with(decision.reason);
      ++totals_.aborted;
      break;
  }
  ++totals_.steps;
  // SPAM's reset: after the update or the restore, before this step's snapshot.
  if (decision.has(Action::kResetMoments)) reset_moments(port_, blamed);
  if (decision.batches_to_skip > 0) {
    skipped_ranges_.push_back({data_position_, decision.batches_to_skip});
    data_position_ += decision.batches_to_skip;
  }
  checkpoint_after(step, decided, global);
}

void StepEngine::checkpoint_after(std::int64_t step, const StepDecision& decided,
                                  const GlobalStats& global) {
  const bool applied = decided.decision.outcome == Outcome::kApplied;
  // The disk checkpoint written after an earlier step becomes visible once the step after it
  // came out clean and every rank has finished writing (the step's collective says so).
  const bool all_written = global.checkpoint_written_ranks >= consensus_->world_size();
  (void)recovery_.settle_pending(step, !decided.signals.any(), all_written);
  const auto t_snapshot = Clock::now();
  if (recovery_.snapshot_due(step, decided.decision.outcome)) {
    RECORD_USER_SCOPE("stepguard::snapshot");
    last_snapshot_step_ = step;  // the replica-check schedule is the same on every rank
    try {
      // Copied in the background; it lands (or is reported failed) at the next settle_snapshot().
      recovery_.begin_snapshot(step, controller_.encode());
      ++totals_.snapshots;
    } catch (const std::exception& e) {
      snapshot_failed(step, e.what());
    }
  }
  stage_seconds_.snapshot = seconds_since(t_snapshot);
  // One checkpoint in flight: one due while the last is still being written is skipped.
  if (recovery_.disk_due(step, applied)) recovery_.write_checkpoint(guard_record(step));
}

void StepEngine::settle_snapshot() noexcept {
  RECORD_USER_SCOPE("stepguard::snapshot_wait");
  const std::int64_t flying = recovery_.snapshot_in_flight();
  try {
    recovery_.finish_snapshot();
    if (flying != 0 && metrics_) metrics_->record_snapshot(recovery_.snapshot_bytes());
  } catch (const std::exception& e) {
    --totals_.snapshots;  // counted when it started
    snapshot_failed(flying, e.what());
  }
}

void StepEngine::snapshot_failed(std::int64_t step, const char* why) {
  // Out of host memory, or optimizer state that cannot be copied: the step stands, and so does
  // every snapshot still held (Recovery forgets those it no longer has).
  std::fprintf(stderr,
               "stepguard: step %" PRId64
               ": the RAM snapshot could not be taken (%s); training goes on, %zu older "
               "snapshot(s) held\n",
               step, why, recovery_.snapshots_held());
  if (metrics_) metrics_->record_snapshot_failure();
}

void StepEngine::export_checkpoint_event(const CheckpointEvent& e) {
  if (!metrics_) return;
  switch (e.kind) {
    case CheckpointEvent::Kind::kWritten:
      metrics_->record_checkpoint(e.step, e.write_seconds);
      break;
    case CheckpointEvent::Kind::kFailed:
      metrics_->record_checkpoint_failure();
      break;
    case CheckpointEvent::Kind::kSkipped:
      metrics_->record_checkpoint_skipped();
      break;
  }
}

void StepEngine::wait_for_background_work() {
  settle_snapshot();
  recovery_.wait_for_checkpoint();
}

// Every replica_every steps, on the step after each snapshot (so a rollback knows which
// snapshots hold agreeing replicas) and on the step after each incident. Only when every rank
// holds replicas only (shards and stages differ by design) and not alone.
bool StepEngine::replica_check_due(std::int64_t step) const {
  const std::int64_t every = controller_.config().detectors.replica_every;
  if (every <= 0 || consensus_->world_size() < 2 || !job_replicated_) return false;
  return step % every == 0 || step == last_snapshot_step_ + 1 || step == last_incident_step_ + 1;
}

void StepEngine::abort_with(const std::string& reason) {
  aborted_ = true;
  abort_reason_ = reason;
}

at::Tensor StepEngine::scale_loss(const at::Tensor& loss) const {
  if (!controller_.loss_scaling() || !options_.enabled()) return loss;
  return loss * replay_scale_.value_or(controller_.loss_scale());
}

}  // namespace stepguard
