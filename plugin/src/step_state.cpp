// StepEngine: the guard's side of a checkpoint (its record), and restoring it: from a front end's
// state dict, or with a resume from a checkpoint directory; and the parameter list the snapshots
// were taken of, followed by identity.
#include <c10/util/Exception.h>

#include <cinttypes>
#include <cstdio>
#include <limits>
#include <string>

#include "csrc/common/bits.h"
#include "csrc/policy/policy_file.h"
#include "csrc/scaling/loss_scaler.h"
#include "plugin/src/step_engine.h"

namespace stepguard {

namespace {

// The words GuardRecord::totals holds, in this order.
constexpr std::size_t kTotalsWords = 8;
constexpr std::int64_t kMaxCount = kMaxDecodedCount;

}  // namespace

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
  snapshot_loaded_ = step_ > 0;
}

void StepEngine::snapshot_loaded_state() {
  if (!snapshot_loaded_) return;
  snapshot_loaded_ = false;
  // The state a resume put back is one the run reached at step_ (the framework loads its part
  // before the first step comes): held as that step's snapshot, so that a rollback before the
  // next scheduled snapshot has a target, as in the run that was not interrupted (which holds it
  // when step_ was a snapshot step). Not counted again: the record's count has it. Taken whole
  // now (before this step's update); the RNG state and buffers are those after this step's
  // forward pass.
  if (recovery_.ring() == nullptr) return;  // no RAM snapshots in this policy
  try {
    recovery_.take_snapshot(step_, controller_.encode());
    last_snapshot_step_ = step_;
  } catch (const std::exception& e) {
    snapshot_failed(step_, e.what());
  }
}

void StepEngine::check_record(const checkpoint::GuardRecord& r) const {
  controller_.check(r.guard, r.step);
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
  check_not_pending("loading the guard's state");
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
  check_not_pending("resume()");
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
  check_not_pending("set_data_position()");
  // The bound a checkpoint's guard record is checked against when it is read back.
  TORCH_CHECK(position >= 0 && position <= kMaxCount, "stepguard: data position must be in [0, ",
              "2^52], got ", position);
  data_position_ = position;
}

void StepEngine::commit_pending_checkpoint() {
  check_not_pending("commit_pending_checkpoint()");
  if (aborted_) return;
  settle_snapshot();
  (void)recovery_.commit_pending();
}

bool StepEngine::same_parameters() const {
  const auto& params = port_.parameters();
  if (params.size() != known_parameters_.size()) return false;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].unsafeGetTensorImpl() != known_parameters_[i]) return false;
  }
  return true;
}

// The port's parameter list changed (a param group added between steps: progressive
// unfreezing; tensors swapped into a group; the same step on every rank, as the loop changes it
// on every rank). The layout is resolved again, and the snapshots, which hold the old list and
// cannot be restored into the new one, are dropped: a rollback before the next snapshot is a
// skip.
void StepEngine::parameters_changed() {
  const std::size_t now = port_.parameters().size();
  const std::size_t held = recovery_.snapshots_held();
  if (held > 0) {
    std::fprintf(stderr,
                 "stepguard: step %" PRId64
                 ": the optimizer's parameters changed (%zu now, %zu before; a group added or "
                 "tensors swapped in): the %zu RAM snapshot(s) of the old list are dropped; a "
                 "rollback before the next snapshot skips instead\n",
                 step_ + 1, now, known_parameters_.size(), held);
    recovery_.clear_snapshots();
  }
  known_parameters_.clear();
  for (const auto& p : port_.parameters()) known_parameters_.push_back(p.unsafeGetTensorImpl());
  refresh_layout();
}

std::string StepEngine::explain_policy() const {
  return policy::explain_policy(controller_.config());
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
  g.metrics_endpoint = metrics_ ? "http://" + metrics_->endpoint() + "/metrics" : std::string();
  return g;
}

void StepEngine::agree_framework_scale(GlobalStats* g) {
  OptimizerPort::FrameworkLossScale& f = *framework_scale_;
  if (!f.scale_tensor.defined()) {
    g->framework_loss_scale = f.scale;
    g->framework_min_scale = f.min_scale;
    return;
  }
  // The same on every rank (the sums' mean): every rank throws alike on a bad one.
  f.scale = g->framework_loss_scale;
  f.min_scale = f.min_scale_tensor.defined() ? g->framework_min_scale : f.min_scale;
  g->framework_min_scale = f.min_scale;
  TORCH_CHECK(f.scale >= scaling::kMinUsableScale && f.scale <= scaling::kMaxUsableScale &&
                  f.min_scale >= 0,
              "stepguard: step ", step_, ": the framework's loss scale and floor are (", f.scale,
              ", ", f.min_scale,
              "); a scale in [2^-126, 2^126] (it and its inverse finite fp32 numbers) and a floor "
              ">= 0 were expected");
}

// A guard that is off: the step is counted (the state stays a run's) and nothing else of the
// guard's runs: no inspection, collective, read of the loss, snapshot or record.
Verdict StepEngine::unguarded_verdict() {
  Verdict v;
  v.step = ++step_;
  ++data_position_;
  v.grad_norm = std::numeric_limits<double>::quiet_NaN();  // not measured
  v.loss_given = false;
  v.loss = std::numeric_limits<double>::quiet_NaN();
  v.guard_id = id_;
  pending_.emplace();
  return v;
}

StepReport StepEngine::unguarded_report(bool applied) {
  StepReport r;
  r.step = step_;
  r.outcome = applied ? Outcome::kApplied : Outcome::kSkipped;
  r.loss_given = false;
  r.loss = std::numeric_limits<double>::quiet_NaN();
  r.grad_norm = std::numeric_limits<double>::quiet_NaN();
  ++totals_.steps;
  ++(applied ? totals_.applied : totals_.skipped);
  return r;
}

}  // namespace stepguard
