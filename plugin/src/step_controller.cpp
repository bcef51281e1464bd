#include "plugin/src/step_controller.h"

#include "csrc/common/bits.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace stepguard {

StepController::StepController(policy::PolicyConfig config, bool loss_scaling, bool framework_scale)
    : config_(config),
      loss_scaling_requested_(loss_scaling),
      framework_scale_(framework_scale),
      engine_(std::move(config)) {
  const policy::PolicyConfig& c = engine_.config();
  if (framework_scale && c.uses(Action::kDropLossScale)) {
    throw std::invalid_argument(
        "stepguard: the policy uses drop_loss_scale, which drops the guard's own loss scale; "
        "here the framework's scaler owns the scale and backs it off on its own overflow path: "
        "use skip_batch");
  }
  if (!framework_scale && (c.has_loss_scale ? c.loss_scale.enabled : loss_scaling)) {
    const policy::LossScaleSettings& l = c.loss_scale;  // defaults = GradScaler's
    scaling::LossScalerConfig sc;
    sc.init_scale = l.init_scale;
    sc.growth_factor = l.growth_factor;
    sc.backoff_factor = l.backoff_factor;
    sc.growth_interval = l.growth_interval;
    sc.hysteresis = l.hysteresis;
    sc.min_scale = l.min_scale;
    scaler_.emplace(sc);
  }
  if (!scaler_ && c.uses(Action::kDropLossScale)) {
    throw std::invalid_argument(
        "stepguard: the policy uses drop_loss_scale but loss scaling is off (add a 'loss_scale' "
        "section or turn loss_scaling on)");
  }
}

StepDecision StepController::decide(std::int64_t step, const GlobalStats& stats,
                                    SnapshotHolder* snapshots) {
  policy::StepInput input;
  input.step = step;
  input.stats = stats;
  if (framework_scale_ && stats.framework_loss_scale > 0) {
    // Steps in a row that overflowed with the framework's scale at its floor: a static scale
    // (its floor is itself) sits there on every step, and only its overflows count.
    const bool stuck = stats.nonfinite() && stats.framework_loss_scale <= stats.framework_min_scale;
    framework_steps_at_floor_ = stuck ? framework_steps_at_floor_ + 1 : 0;
  }
  input.loss_scale_steps_at_floor =
      scaler_ ? scaler_->state().steps_at_floor : framework_steps_at_floor_;
  input.loss_scale_can_drop =
      scaler_ ? !scaler_->at_floor() : stats.framework_loss_scale > stats.framework_min_scale;
  input.lr_factor = lr_.factor();
  policy::Verdict verdict = engine_.evaluate(input);
  StepDecision out;
  update_knobs(stats, &verdict.decision);
  out.lr_factor = lr_.factor();
  if (!verdict.decision.has(Action::kLowerLr)) {
    lr_.on_step(verdict.decision.outcome == Outcome::kApplied && !verdict.signals.any());
  }
  // The framework's scale when its scaler owns it (the one this step's backward used; the
  // framework backs it off or grows it in its own step).
  out.loss_scale =
      !scaler_ && stats.framework_loss_scale > 0 ? stats.framework_loss_scale : loss_scale();
  out.signals = std::move(verdict.signals);
  out.decision = std::move(verdict.decision);
  // While a loss spike's recovery is watched, the training is suspect: its snapshots are not
  // confirmed, so a rollback goes back to one from before the spike.
  if (snapshots != nullptr) snapshots->on_step(step, !out.signals.any() && !engine_.watching());
  if (out.decision.outcome == Outcome::kRolledBack) {
    settle_rollback(step, !stats.diverged_replicas.empty(), snapshots, &out);
  }
  return out;
}

void StepController::update_knobs(const GlobalStats& stats, Decision* d) {
  if (scaler_) {
    // GradScaler's rule on every step, then the policy's extra drop.
    const double before = scaler_->scale();
    scaler_->update(stats.nonfinite());
    if (d->has(Action::kDropLossScale)) scaler_->drop(d->loss_scale_factor);
    if (scaler_->scale() < before && !d->has(Action::kDropLossScale) &&
        d->outcome != Outcome::kAborted) {
      // The backoff is an action too: it shows in the trace and the metrics.
      d->actions.push_back(Action::kDropLossScale);
      std::sort(d->actions.begin(), d->actions.end());
    }
  }
  if (d->has(Action::kLowerLr)) {
    lr_.lower(d->lower_lr.factor, d->lower_lr.floor, d->lower_lr.recover_after,
              d->lower_lr.recover_over);
  }
}

void StepController::settle_rollback(std::int64_t step, bool replicas_diverged,
                                     SnapshotHolder* snapshots, StepDecision* out) {
  Decision& d = out->decision;
  const std::optional<RollbackTarget> target =
      snapshots != nullptr ? snapshots->roll_back(step, replicas_diverged) : std::nullopt;
  if (target) {
    const std::int64_t to_step = target->step;
    rollback_to(target->words, d, step);
    if (scaler_) out->loss_scale = loss_scale();  // a framework's scale is the framework's
    out->lr_factor = lr_factor();
    out->rolled_back_to = to_step;
    d.reason += " (rolled back to step " + std::to_string(to_step) + ")";
    return;
  }
  // Nothing confirmed to go back to yet: the batch is skipped and the loop is still told how many
  // batches to drop.
  d.outcome = Outcome::kSkipped;
  d.actions.erase(std::remove(d.actions.begin(), d.actions.end(), Action::kRollback),
                  d.actions.end());
  d.actions.insert(d.actions.begin(), Action::kSkipBatch);
  d.reason += " (no confirmed snapshot to roll back to yet: skipped instead)";
}

std::vector<std::int64_t> StepController::encode() const {
  std::vector<std::int64_t> words = engine_.state().encode();
  const scaling::LossScalerState sc = scaler_ ? scaler_->state() : scaling::LossScalerState{};
  for (std::int64_t v :
       {bits_of(sc.scale), sc.growth_tracker, sc.hysteresis_left, sc.steps_at_floor}) {
    words.push_back(v);
  }
  const scaling::LrControllerState& l = lr_.state();
  for (std::int64_t v : {bits_of(l.factor), bits_of(l.recovery_start), l.good_steps,
                         l.recover_after, l.recover_over, l.recovered_steps}) {
    words.push_back(v);
  }
  return words;
}

void StepController::check(const std::vector<std::int64_t>& words, std::int64_t step) const {
  StepController probe(config_, loss_scaling_requested_, framework_scale_);
  probe.decode(words, /*quiet=*/true);
  probe.engine_.state().check_not_after(step);
}

void StepController::decode(const std::vector<std::int64_t>& words, bool quiet) {
  constexpr std::size_t kTail = 4 + 6;  // scaler, LR controller
  if (words.size() < kTail) throw std::invalid_argument("stepguard: guard state is truncated");
  const std::size_t n = words.size() - kTail;
  bool rules_reset = false;
  const policy::EngineState engine = policy::EngineState::decode(
      std::vector<std::int64_t>(words.begin(), words.begin() + static_cast<std::ptrdiff_t>(n)),
      engine_.config().rules.size(), policy::rules_digest(engine_.config().rules), &rules_reset);
  const std::int64_t* w = words.data() + n;
  const scaling::LossScalerState sc{double_of(w[0]), w[1], w[2], w[3]};
  const scaling::LrControllerState lr{double_of(w[4]), double_of(w[5]), w[6], w[7], w[8], w[9]};
  try {
    if (scaler_) scaler_->check(sc);
    scaling::LrController::check(lr);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("stepguard: guard state: ") + e.what());
  }
  engine_.restore(engine);
  if (scaler_) scaler_->restore(sc);
  lr_.restore(lr);
  if (rules_reset && !quiet) {
    std::fprintf(stderr,
                 "stepguard: the guard state was saved under a policy with other rules: each "
                 "rule's streak, window and cooldown start afresh (the loss scale, the LR factor, "
                 "the detectors' averages and the budgets are kept)\n");
  }
}

void StepController::rollback_to(const std::vector<std::int64_t>& words, const Decision& decision,
                                 std::int64_t step) {
  StepController snapshot(config_, loss_scaling_requested_, framework_scale_);
  snapshot.decode(words);
  engine_.restore_detectors(snapshot.engine_.state());
  if (scaler_) scaler_->restore(snapshot.scaler_->state());
  // A rollback while a loss spike's recovery is watched (a spike before this one did not stay
  // fixed) keeps the LR factor as this step left it, its own cut included (update_knobs): the
  // state restored is the one that diverged under the cuts made since.
  const policy::RecoveryWatch& watch = engine_.state().watch;
  const bool keep_lr = watch.started > 0 && watch.started < step;
  if (!keep_lr) lr_.restore(snapshot.lr_.state());
  if (scaler_ && decision.has(Action::kDropLossScale)) {
    // The restored scale is the one that led here: back off from it as this step did.
    scaler_->drop(decision.loss_scale_factor < 1.0 ? decision.loss_scale_factor
                                                   : scaler_->config().backoff_factor);
  }
  if (decision.has(Action::kLowerLr) && !keep_lr) {
    lr_.lower(decision.lower_lr.factor, decision.lower_lr.floor, decision.lower_lr.recover_after,
              decision.lower_lr.recover_over);
  }
}

void StepController::reset() {
  *this = StepController(config_, loss_scaling_requested_, framework_scale_);
}

StepReport make_report(std::int64_t step, const GlobalStats& stats, const StepDecision& decided) {
  StepReport r;
  r.outcome = decided.decision.outcome;
  r.step = step;
  r.loss = stats.loss;
  r.loss_given = stats.loss_given_ranks > 0;
  r.grad_norm = stats.grad_norm;
  r.nonfinite_count = stats.nonfinite_count();
  r.actions = decided.decision.actions;
  r.action = strongest_action(r.actions);
  r.batches_to_skip = decided.decision.batches_to_skip;
  r.loss_scale = decided.loss_scale;
  r.lr_factor = decided.lr_factor;
  r.rolled_back_to = decided.rolled_back_to;
  return r;
}

std::uint64_t StepController::digest(std::int64_t step) const {
  std::vector<std::int64_t> words = encode();
  words.push_back(step);
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::int64_t v : words) {
    for (int byte = 0; byte < 8; ++byte) {
      h ^= static_cast<std::uint64_t>(v >> (8 * byte)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

}  // namespace stepguard
