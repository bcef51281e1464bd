// StepEngine: the pipeline of one guarded step and the state it keeps between steps. The record
// stage and forensics live in step_record.cpp.
#include "plugin/src/step_engine.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>

#include "csrc/consensus/process_group_consensus.h"

namespace stepguard {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::unique_ptr<consensus::Consensus> make_consensus(const GuardOptions& o) {
  if (!o.process_group()) return std::make_unique<consensus::LocalConsensus>();
  return std::make_unique<consensus::ProcessGroupConsensus>(o.process_group(),
                                                            o.collective_timeout(), o.store());
}

StepController make_controller(const EngineConfig& config) {
  try {
    return StepController(config.policy, config.loss_scaling);
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

// The words GuardRecord::totals holds, in this order.
constexpr std::size_t kTotalsWords = 8;

}  // namespace

StepEngine::StepEngine(OptimizerPort& port, GuardOptions options)
    : port_(port),
      options_(std::move(options)),
      config_(resolve_config(options_)),
      consensus_(make_consensus(options_)),
      controller_(make_controller(config_)),
      recovery_(*consensus_, port_, recovery_config(options_, config_)) {
  metrics_ = open_metrics(options_, consensus_->rank(), controller_.loss_scale_floor(),
                          config_.disk_every);
  event_log_ = open_trace(options_);
  recovery_.on_checkpoint_event([this](const CheckpointEvent& e) { export_checkpoint_event(e); });
}

StepEngine::~StepEngine() { wait_for_background_work(); }

StepReport StepEngine::step(const at::Tensor& loss) {
  // Stage times for last_stage_seconds(): inspect counts the checks and the packing, record counts
  // forensics, and act leaves out the snapshot (timed here and in checkpoint_after).
  stage_seconds_ = StageSeconds{};
  auto t = Clock::now();
  // The snapshot copied while the loop ran forward and backward lands before anything below can
  // change what it reads (a rollback, the optimizer step, a restore).
  settle_snapshot();
  const double settled = seconds_since(t);
  t = Clock::now();
  check_can_step(loss);
  const std::int64_t step = step_ + 1;
  const Agreed agreed = inspect_and_agree(loss, step);
  stage_seconds_.agree = agreed.agree_seconds;
  stage_seconds_.inspect = seconds_since(t) - agreed.agree_seconds;
  t = Clock::now();
  const StepDecision decided = decide(step, agreed.global);
  stage_seconds_.decide = seconds_since(t);
  t = Clock::now();
  const Findings findings = investigate(agreed, decided);
  stage_seconds_.record = seconds_since(t);
  t = Clock::now();
  act(step, agreed.global, decided);
  stage_seconds_.act = seconds_since(t) - stage_seconds_.snapshot;
  stage_seconds_.snapshot += settled;  // the wait for the last step's copy
  t = Clock::now();
  StepReport report = record(step, agreed, decided, findings);
  stage_seconds_.record += seconds_since(t);
  return report;
}

void StepEngine::check_can_step(const at::Tensor& loss) {
  TORCH_CHECK(!aborted_, "stepguard: training was aborted at step ", step_, " (", abort_reason_,
              "); step() refuses to run after an abort");
  port_.refresh();
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
std::optional<at::Device> StepEngine::gradient_device() const {
  for (const auto& p : port_.parameters()) {
    if (p.grad().defined()) return p.grad().device();
  }
  return std::nullopt;
}

// 1 inspect, 2 agree: the fused pass writes the step buffer on the gradients' device, the one
// collective sums it, and its one read to the host yields the agreed statistics.
StepEngine::Agreed StepEngine::inspect_and_agree(const at::Tensor& loss, std::int64_t step) {
  Agreed a;
  inspect::InspectOptions inspect_options;
  if (controller_.loss_scaling()) {
    // The fused pass unscales in place: the optimizer then sees true gradients.
    inspect_options.inv_scale = controller_.inv_loss_scale();
    inspect_options.unscale_in_place = true;
  }
  if (!step_device_) {
    // No gradient and no loss: the buffer goes where the parameters are.
    const auto& params = port_.parameters();
    step_device_ = params.empty() ? at::Device(at::kCPU) : params.front().device();
  }
  consensus::StepBuffer buffer(consensus_->rank(), consensus_->world_size(), *step_device_);
  const auto t_inspect = Clock::now();
  // Validation inside inspection throws before anything changes.
  inspect::inspect_into(port_.gradients(), inspect_options, buffer.inspection_block(), &a.local,
                        &a.blame);
  a.inspect_seconds = seconds_since(t_inspect);
  consensus::LocalEvidence local_evidence;
  if (input_check_) {
    local_evidence.inputs_bad = input_check_->known_bad();
    local_evidence.inputs_counted = input_check_->any_counted();
  }
  local_evidence.probe_bad = probes_.any_nonfinite();
  local_evidence.checkpoint_written = recovery_.checkpoint_written();
  std::optional<at::Tensor> fingerprint;
  if (replica_check_due(step)) fingerprint = consensus::parameter_fingerprint(port_.parameters());
  buffer.pack(loss, controller_.digest(step_), local_evidence, fingerprint);
  step_ = step;
  ++data_position_;  // this step's batch
  const auto t_agree = Clock::now();
  try {
    consensus_->all_reduce_sum(buffer.tensor(), step);
    a.global = buffer.unpack(step, options_.sharded_gradients());
    // The rare step where a count says a rank saw something or differs: one more collective
    // names the ranks (the steady-state buffer is the same size at any world size).
    if (consensus::needs_rank_detail(a.global)) {
      consensus::fill_rank_detail(consensus::gather_rank_rows(*consensus_, buffer.rank_row(), step),
                                  consensus_->world_size(), &a.global);
    }
    if (a.global.replica_checked && a.global.diverged_replicas.empty()) {
      recovery_.replicas_agreed_before(step);  // snapshots taken before hold agreeing replicas
    }
  } catch (const std::exception& e) {
    // The ranks can no longer agree: nothing may be applied from here on. A ConsensusError
    // (naming the step and the missing ranks) goes to the caller as it is.
    abort_with(e.what());
    throw;
  }
  a.agree_seconds = seconds_since(t_agree);
  return a;
}

// 3 detect, 4 decide: the same on every rank (a function of the agreed stats and state).
StepDecision StepEngine::decide(std::int64_t step, const GlobalStats& global) {
  step_loss_scale_ = controller_.loss_scale();
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

// 5 act: restore, apply or drop the step, then the snapshot and checkpoint cadence.
void StepEngine::act(std::int64_t step, const GlobalStats& global, const StepDecision& decided) {
  const Decision& decision = decided.decision;
  switch (decision.outcome) {
    case Outcome::kApplied:
      if (decision.has(Action::kClip)) {
        // ZClip-style: one factor for every gradient, so the global norm becomes the target.
        if (global.grad_norm > decision.clip_norm && decision.clip_norm > 0) {
          at::NoGradGuard no_grad;
          for (auto& g : port_.gradients()) {
            if (g.defined()) g.mul_(decision.clip_norm / global.grad_norm);
          }
        }
      }
      port_.apply(decided.lr_factor);
      ++totals_.applied;
      break;
    case Outcome::kSkipped:
      if (options_.zero_grad_on_skip()) port_.discard();
      ++totals_.skipped;
      break;
    case Outcome::kRolledBack:
      try {
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
      if (options_.zero_grad_on_skip()) port_.discard();
      abort_with(decision.reason);
      ++totals_.aborted;
      break;
  }
  ++totals_.steps;
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
// snapshots hold agreeing replicas) and on the step after each incident. Not with sharded
// parameters (their fingerprints differ by design) and not alone.
bool StepEngine::replica_check_due(std::int64_t step) const {
  const std::int64_t every = controller_.config().detectors.replica_every;
  if (every <= 0 || consensus_->world_size() < 2 || options_.sharded_gradients()) return false;
  return step % every == 0 || step == last_snapshot_step_ + 1 || step == last_incident_step_ + 1;
}

void StepEngine::abort_with(const std::string& reason) {
  aborted_ = true;
  abort_reason_ = reason;
}

GuardStats StepEngine::stats() {
  settle_snapshot();  // a copy that failed changes the counts
  GuardStats g;
  g.step_count = step_;
  g.totals = totals_;
  g.aborted = aborted_;
  g.consecutive_bad_steps = controller_.engine_state().consecutive_bad_steps;
  g.bad_steps_total = controller_.engine_state().bad_steps_total;
  g.loss_scale = controller_.loss_scale();
  g.lr_factor = controller_.lr_factor();
  g.rank = consensus_->rank();
  g.world_size = consensus_->world_size();
  g.data_position = data_position_;
  g.skipped_ranges = skipped_ranges_;
  g.snapshots_held = static_cast<std::int64_t>(recovery_.snapshots_held());
  g.snapshot_bytes = recovery_.snapshot_bytes();
  const CheckpointCounts& c = recovery_.checkpoint_counts();
  g.checkpoints_written = c.written;
  g.checkpoints_failed = c.failed;
  g.checkpoints_skipped = c.skipped;
  g.collective_calls = consensus_->collectives();
  g.collective_bytes = consensus_->bytes();
  g.step_buffer_bytes = consensus::StepBuffer::bytes();
  g.last_step_seconds = stage_seconds_;
  g.metrics_endpoint = metrics_ ? metrics_->endpoint() : std::string();
  return g;
}

at::Tensor StepEngine::scale_loss(const at::Tensor& loss) const {
  if (!controller_.loss_scaling()) return loss;
  return loss * replay_scale_.value_or(controller_.loss_scale());
}

checkpoint::GuardRecord StepEngine::guard_record(std::int64_t at_step) const {
  checkpoint::GuardRecord r;
  r.step = at_step;
  r.data_position = data_position_;
  r.guard = controller_.encode();
  r.totals = {
      totals_.steps,   totals_.applied,   totals_.skipped,   totals_.rolled_back,
      totals_.aborted, totals_.incidents, totals_.snapshots, recovery_.checkpoint_counts().written};
  for (const auto& [first, count] : skipped_ranges_) {
    r.skipped_ranges.push_back(first);
    r.skipped_ranges.push_back(count);
  }
  return r;
}

void StepEngine::restore_record(const checkpoint::GuardRecord& record) {
  controller_.decode(record.guard);
  step_ = record.step;
  data_position_ = record.data_position;
  const auto& t = record.totals;
  totals_ = GuardTotals{t[0], t[1], t[2], t[3], t[4], t[5], t[6]};
  recovery_.set_checkpoints_written(t[7]);
  skipped_ranges_.clear();
  for (std::size_t i = 0; i + 1 < record.skipped_ranges.size(); i += 2) {
    skipped_ranges_.push_back({record.skipped_ranges[i], record.skipped_ranges[i + 1]});
  }
  recovery_.clear_snapshots();
}

void StepEngine::check_record(const checkpoint::GuardRecord& r) const {
  controller_.check(r.guard, r.step);
  // Far beyond any run (2^52 steps), far inside int64: a step counter that cannot overflow.
  constexpr std::int64_t kMaxCount = std::int64_t{1} << 52;
  const auto field = [](const char* name, std::int64_t value) {
    if (value < 0 || value > kMaxCount) {
      throw checkpoint::CheckpointError(std::string("its guard record's '") + name + "' is " +
                                        std::to_string(value) + ", not in [0, 2^52]");
    }
  };
  field("step", r.step);
  field("data_position", r.data_position);
  if (r.totals.size() != kTotalsWords) {
    throw checkpoint::CheckpointError("its guard record's 'totals' has " +
                                      std::to_string(r.totals.size()) + " words, not " +
                                      std::to_string(kTotalsWords));
  }
  for (std::int64_t t : r.totals) field("totals", t);
  if (r.skipped_ranges.size() % 2 != 0) {
    throw checkpoint::CheckpointError("its guard record's 'skipped_ranges' has an odd length");
  }
  for (std::int64_t v : r.skipped_ranges) field("skipped_ranges", v);
}

void StepEngine::load_record(const checkpoint::GuardRecord& record) {
  try {
    check_record(record);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "stepguard: the guard state does not fit this guard: ", e.what());
  }
  settle_snapshot();
  restore_record(record);
}

std::int64_t StepEngine::resume(const std::string& dir) {
  TORCH_CHECK(!aborted_, "stepguard: resume() after an abort");
  settle_snapshot();
  // A record is accepted only when all of it can be restored.
  auto check = [this](const checkpoint::GuardRecord& r) { check_record(r); };
  const std::optional<checkpoint::GuardRecord> record = recovery_.resume(dir, check);
  if (!record) return 0;
  restore_record(*record);
  if (consensus_->rank() == 0) {
    std::fprintf(stderr,
                 "stepguard: resumed from %s (step %" PRId64 ", data position %" PRId64 ")\n",
                 checkpoint::step_dir(dir, step_).c_str(), step_, data_position_);
  }
  return step_;
}

void StepEngine::set_data_position(std::int64_t position) {
  TORCH_CHECK(position >= 0, "stepguard: data position must be >= 0, got ", position);
  data_position_ = position;
}

void StepEngine::commit_pending_checkpoint() {
  if (aborted_) return;
  settle_snapshot();
  (void)recovery_.commit_pending();
}

}  // namespace stepguard
