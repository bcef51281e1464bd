#include "csrc/policy/policy.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace stepguard {
namespace policy {

namespace {

// Keeps the newest `keep` entries of a step list (newest last).
void trim(std::vector<std::int64_t>* steps, std::size_t keep) {
  if (steps->size() > keep) steps->erase(steps->begin(), steps->end() - keep);
}

// Actions from rules and limits, merged: each action once, with its strongest parameters.
class ActionSet {
 public:
  void add(const ActionSpec& spec, double clip_norm) {
    present_[static_cast<int>(spec.type)] = true;
    switch (spec.type) {
      case Action::kDropLossScale:
        decision_.loss_scale_factor = std::min(decision_.loss_scale_factor, spec.factor);
        break;
      case Action::kLowerLr:
        // The deepest cut wins, with its own floor and recovery.
        if (!lr_set_ || spec.factor < decision_.lower_lr.factor) {
          decision_.lower_lr = {spec.factor, spec.floor, spec.recover_after, spec.recover_over};
          lr_set_ = true;
        }
        break;
      case Action::kClip:
        decision_.clip_norm =
            decision_.clip_norm > 0 ? std::min(decision_.clip_norm, clip_norm) : clip_norm;
        break;
      case Action::kRollback:
        decision_.batches_to_skip = std::max(decision_.batches_to_skip, spec.skip_batches);
        break;
      default:
        break;
    }
  }
  void add(Action a) { present_[static_cast<int>(a)] = true; }
  bool has(Action a) const { return present_[static_cast<int>(a)]; }

  // The combination rules: abort wins over everything; rollback subsumes skip; a step that is
  // not applied is not clipped; loss-scale and LR changes survive a skip or a rollback (they
  // are applied after the restore).
  Decision finish() {
    Decision d = decision_;
    if (has(Action::kAbort)) {
      d.outcome = Outcome::kAborted;
      const bool alert = has(Action::kAlert);
      present_.fill(false);
      add(Action::kAbort);
      if (alert) add(Action::kAlert);
    } else if (has(Action::kRollback)) {
      d.outcome = Outcome::kRolledBack;
      present_[static_cast<int>(Action::kSkipBatch)] = false;
      present_[static_cast<int>(Action::kClip)] = false;
    } else if (has(Action::kSkipBatch)) {
      d.outcome = Outcome::kSkipped;
      present_[static_cast<int>(Action::kClip)] = false;
    } else {
      d.outcome = Outcome::kApplied;
      add(Action::kApply);
    }
    if (!has(Action::kRollback)) d.batches_to_skip = 0;
    if (!has(Action::kClip)) d.clip_norm = 0.0;
    if (!has(Action::kDropLossScale)) d.loss_scale_factor = 1.0;
    if (!has(Action::kLowerLr)) d.lower_lr = LrChange{};
    d.actions.clear();
    for (int i = 0; i < kCount; ++i) {
      if (present_[i]) d.actions.push_back(static_cast<Action>(i));
    }
    return d;
  }
  Outcome outcome_so_far() {
    ActionSet copy = *this;
    return copy.finish().outcome;
  }

 private:
  static constexpr int kCount = static_cast<int>(Action::kResetMoments) + 1;
  std::array<bool, kCount> present_{};
  Decision decision_;
  bool lr_set_ = false;
};

// Records an event at `step` against a budget; true when more than `count` events fell within
// `window` steps (the record then starts over, so the budget fires once per overrun).
bool budget_spent(const Budget& budget, std::int64_t step, std::vector<std::int64_t>* events) {
  events->push_back(step);
  trim(events, static_cast<std::size_t>(budget.count + 1));
  if (static_cast<std::int64_t>(events->size()) > budget.count &&
      events->front() > step - budget.window) {
    events->clear();
    return true;
  }
  return false;
}

std::string step_span(std::int64_t step, std::int64_t since) {
  const std::int64_t n = step - since;
  return std::to_string(n) + " step" + (n == 1 ? "" : "s");
}

std::string signal_list(const Signals& signals) {
  std::string out;
  for (Signal s : signals.raised) out += (out.empty() ? "" : ", ") + std::string(to_string(s));
  return out;
}

// What the raised signals measured, for the decision's reason ("nonfinite_grad (...)").
void describe_signals(const Signals& signals, const GlobalStats& stats, std::int64_t step,
                      const RecoveryWatch& watch, std::ostream& detail) {
  const auto ranks = [&detail](const std::vector<int>& list) {
    detail << " (rank" << (list.size() > 1 ? "s" : "");
    for (std::size_t i = 0; i < list.size(); ++i) detail << (i ? ", " : " ") << list[i];
  };
  if (signals.has(Signal::kRankDesync)) {
    ranks(signals.desynced_ranks);
    detail << " diverged: guard state differs from the other ranks)";
  }
  if (signals.has(Signal::kReplicaDivergence)) {
    ranks(signals.diverged_replicas);
    detail << ": parameters differ from the other replicas)";
  }
  if (signals.has(Signal::kLossSpike) || signals.has(Signal::kLossRatio)) {
    detail << " (loss " << stats.loss;
    if (std::isfinite(stats.loss_max_bound) && stats.loss_max_bound > stats.loss * 1.5) {
      detail << ", one rank's up to " << stats.loss_max_bound;
    }
    detail << ", level before " << signals.loss_level << ")";
  }
  if (signals.has(Signal::kLossNotRecovered)) {
    detail << " (the loss is " << watch.loss_now << " " << step_span(step, signals.diverging_since)
           << " after the spike at step " << signals.diverging_since << ", its level before "
           << signals.loss_level << "; raised " << signals.escalations << " time"
           << (signals.escalations > 1 ? "s" : "") << ")";
  }
  if (signals.has(Signal::kOverflow)) {
    detail << " (Inf in the gradients under loss scaling: the scale backs off)";
  }
}

// A decision's reason: the signals raised, what they measured, and the rules and limits that
// acted ("nonfinite_grad (...) -> skip-nonfinite").
std::string decision_reason(const Signals& signals, const std::string& detail,
                            const std::vector<std::string>& rules) {
  std::string reason = signal_list(signals) + detail;
  if (!rules.empty()) {
    reason += " -> ";
    for (std::size_t i = 0; i < rules.size(); ++i) {
      reason += (i ? ", " : "") + rules[i];
    }
  }
  return reason;
}

}  // namespace

bool PolicyConfig::uses(Action action) const noexcept {
  for (const Rule& r : rules) {
    if (r.action.type == action) return true;
  }
  return (limits.max_skips.enabled && limits.max_skips.action.type == action) ||
         (limits.max_rollbacks.enabled && limits.max_rollbacks.action.type == action) ||
         (limits.loss_scale_floor_steps > 0 && limits.loss_scale_floor_action.type == action);
}

PolicyEngine::PolicyEngine(PolicyConfig config)
    : config_(std::move(config)),
      loss_spike_(config_.detectors.loss_spike.ema),
      grad_norm_spike_(config_.detectors.grad_norm_spike.ema),
      loss_ratio_(config_.detectors.loss_ratio.ratio) {
  if (config_.limits.max_consecutive_bad_steps < 0) {
    throw std::invalid_argument("stepguard: max_consecutive_bad_steps must be >= 0, got " +
                                std::to_string(config_.limits.max_consecutive_bad_steps));
  }
  for (const Rule& r : config_.rules) {
    if (r.on == 0 || r.consecutive < 1 || r.cooldown < 0 || r.after_step < 0 ||
        r.within_count < 0 || (r.within_count > 0 && r.within_steps < r.within_count)) {
      throw std::invalid_argument("stepguard: policy rule '" + r.name + "' is inconsistent");
    }
  }
  state_.rules.resize(config_.rules.size());
  state_.rules_digest = rules_digest(config_.rules);
  const std::vector<TrendKind>& kinds = trend_kinds();
  if (config_.detectors.trends.size() != kinds.size()) {
    throw std::invalid_argument("stepguard: the policy's trend detector settings do not match");
  }
  state_.trends.resize(kinds.size());
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    const TrendSettings& t = config_.detectors.trends[i];
    trends_.push_back(t.enabled ? kinds[i].make(t.values) : nullptr);
  }
}

void PolicyEngine::restore(const EngineState& state) {
  if (state.rules.size() != config_.rules.size()) {
    throw std::invalid_argument("stepguard: restored policy state holds " +
                                std::to_string(state.rules.size()) + " rules, the policy has " +
                                std::to_string(config_.rules.size()));
  }
  EngineState next = state;
  next.rules_digest = rules_digest(config_.rules);
  restore_trends(next.trends);
  state_ = std::move(next);
}

void PolicyEngine::restore_detectors(const EngineState& state) {
  std::vector<std::vector<double>> trends = state.trends;
  restore_trends(trends);
  state_.loss_ema = state.loss_ema;
  state_.grad_norm_ema = state.grad_norm_ema;
  state_.loss_ratio = state.loss_ratio;
  state_.trends = std::move(trends);
}

void PolicyEngine::restore_trends(std::vector<std::vector<double>>& trends) {
  trends.resize(trends_.size());  // a state of an earlier release: fresh detectors
  try {
    for (std::size_t i = 0; i < trends_.size(); ++i) {
      if (trends_[i] == nullptr) {
        trends[i].clear();  // off in this policy
      } else {
        trends_[i]->restore(trends[i]);
      }
    }
  } catch (const std::invalid_argument&) {
    for (std::size_t i = 0; i < trends_.size(); ++i) {  // every detector as it was
      if (trends_[i] != nullptr) trends_[i]->restore(state_.trends[i]);
    }
    throw;
  }
}

void PolicyEngine::detect_trends(const StepInput& input, Signals* signals) {
  const GlobalStats& g = input.stats;
  TrendInput in;
  in.step = input.step;
  in.stats = &g;
  in.judged = g.nonfinite_count() == 0 && g.loss_nonfinite_ranks == 0 && !g.sum_squares_overflow &&
              std::isfinite(g.grad_norm);
  in.lr_factor = input.lr_factor;
  in.watching = state_.watch.started > 0;
  for (std::size_t i = 0; i < trends_.size(); ++i) {
    if (trends_[i] == nullptr) continue;
    TrendNote note;
    if (trends_[i]->observe(in, &note)) {
      signals->raised.push_back(note.signal);
      if (note.signal == Signal::kRankLossShift && signals->loss_level == 0.0) {
        signals->loss_level = note.reference;  // the level the rank is named against
      }
      signals->trends.push_back(std::move(note));
    }
    state_.trends[i] = trends_[i]->state();
  }
}

void PolicyEngine::detect(const StepInput& input, Signals* signals) {
  const GlobalStats& stats = input.stats;
  // The loss comes first: a non-finite loss makes every gradient non-finite, not the reverse.
  if (stats.loss_nonfinite_ranks > 0) signals->raised.push_back(Signal::kNonfiniteLoss);
  if (stats.nonfinite_count() > 0) {
    // NaN/Inf in the gradients of a finite loss under loss scaling, with room to back off: an fp16
    // overflow, as GradScaler and DeepSpeed's scaler take it, whatever share of the Inf became
    // NaN on the way (Inf - Inf in a gradient average, 0 * Inf). Not when a replay in fp32
    // reproduced this streak, nor with the scale at its floor: then it escalates.
    const bool overflow =
        input.loss_scale_can_drop && stats.loss_nonfinite_ranks == 0 && !stats.overflow_ruled_out;
    signals->raised.push_back(overflow ? Signal::kOverflow : Signal::kNonfiniteGrad);
  }
  if (!stats.desynced_ranks.empty()) {
    signals->raised.push_back(Signal::kRankDesync);
    signals->desynced_ranks = stats.desynced_ranks;
  }
  const bool bad = signals->any();
  // A diverged replica is the rules' business (roll back, abort; alert when none acts): the step
  // itself is finite and does not count as bad.
  if (!stats.diverged_replicas.empty()) {
    signals->raised.push_back(Signal::kReplicaDivergence);
    signals->diverged_replicas = stats.diverged_replicas;
  }
  // Value detectors see only finite values: the loss with finite gradients too (a NaN step is
  // skipped whole; its high loss is the same bad sample, not a divergence), the grad norm.
  const DetectorSettings& d = config_.detectors;
  const bool loss_finite = stats.loss_nonfinite_ranks == 0 && std::isfinite(stats.loss);
  double spike_level = std::numeric_limits<double>::quiet_NaN();  // set on a loss spike
  const double grad_norm_level = state_.grad_norm_ema.mean;       // before this step's
  if (loss_finite && stats.nonfinite_count() == 0) {
    if (d.loss_spike.enabled) {
      loss_spike_.restore(state_.loss_ema);
      // The recent ratio judges the largest rank loss: one rank's spike is not averaged away.
      const SpikeVerdict v = loss_spike_.observe(stats.loss, stats.loss_max_bound);
      if (v.spike) {
        signals->raised.push_back(Signal::kLossSpike);
        spike_level = v.reference;
      }
      state_.loss_ema = loss_spike_.state();
    }
    if (d.loss_ratio.enabled) {
      loss_ratio_.restore(state_.loss_ratio);
      if (loss_ratio_.observe(stats.loss)) {
        signals->raised.push_back(Signal::kLossRatio);
        if (!std::isfinite(spike_level)) {
          spike_level =
              state_.loss_ema.count > 0 ? state_.loss_ema.mean : state_.loss_ratio.reference_max;
        }
      }
      state_.loss_ratio = loss_ratio_.state();
    }
  }
  if (d.grad_norm_spike.enabled && stats.nonfinite_count() == 0 && !stats.sum_squares_overflow &&
      std::isfinite(stats.grad_norm)) {
    grad_norm_spike_.restore(state_.grad_norm_ema);
    if (grad_norm_spike_.observe(stats.grad_norm).spike) {
      signals->raised.push_back(Signal::kGradNormSpike);
    }
    state_.grad_norm_ema = grad_norm_spike_.state();
  }
  if (std::isfinite(spike_level)) signals->loss_level = spike_level;
  if (d.loss_recovery.enabled) {
    watch_recovery(input.step, loss_finite ? stats.loss : std::nan(""), spike_level,
                   grad_norm_level, signals);
  }
  // A bad step cannot be applied as is (non-finite values, diverged replicas). Spikes are the
  // rules' business and do not count here.
  if (bad) {
    ++state_.consecutive_bad_steps;
    ++state_.bad_steps_total;
  } else {
    state_.consecutive_bad_steps = 0;
  }
  signals->consecutive_bad_steps = state_.consecutive_bad_steps;
  if (config_.limits.max_consecutive_bad_steps > 0 &&
      state_.consecutive_bad_steps >= config_.limits.max_consecutive_bad_steps) {
    signals->raised.push_back(Signal::kConsecutiveLimit);
  }
}

void PolicyEngine::watch_recovery(std::int64_t step, double loss, double level,
                                  double grad_norm_level, Signals* signals) {
  RecoveryWatch& w = state_.watch;
  const DetectorSettings::Recovery& r = config_.detectors.loss_recovery;
  const auto tell = [&] {
    signals->loss_level = w.loss_level;
    signals->grad_norm_level = w.grad_norm_level;
    signals->diverging_since = w.started;
    signals->escalations = w.escalations;
  };
  if (std::isfinite(level)) {
    // A spike starts the watch, or restarts the window of one under way (the level stays the
    // one from before the first spike: a second spike is not the new normal).
    if (w.started == 0) {
      w = RecoveryWatch{};
      w.started = step;
      w.loss_level = level;
      w.grad_norm_level = std::isfinite(grad_norm_level) ? grad_norm_level : 0.0;
    }
    w.window_start = step;
    w.loss_now = w.loss_level;
    tell();
    return;
  }
  if (w.started == 0 || !std::isfinite(loss)) return;
  w.loss_now += 0.25 * (loss - w.loss_now);
  if (step - w.window_start < r.within) return;
  if (!rose_above(w.loss_now, w.loss_level, std::abs(w.loss_level), r.factor)) {
    w = RecoveryWatch{};  // back near its level: contained
    return;
  }
  ++w.escalations;
  w.window_start = step;
  signals->raised.push_back(Signal::kLossNotRecovered);
  tell();
}

void PolicyEngine::run_rules(std::int64_t step, const Signals& signals,
                             std::vector<const Rule*>* fired) {
  SignalSet raised = 0;
  for (Signal s : signals.raised) raised |= bit(s);
  for (std::size_t i = 0; i < config_.rules.size(); ++i) {
    const Rule& rule = config_.rules[i];
    RuleState& rs = state_.rules[i];
    const bool matched = (raised & rule.on) != 0;
    if (!matched) {
      rs.streak = 0;
      continue;
    }
    ++rs.streak;
    if (rule.within_count > 0) {
      rs.recent.push_back(step);
      trim(&rs.recent, static_cast<std::size_t>(rule.within_count));
    }
    if (step <= rule.after_step) continue;
    if (rs.streak % rule.consecutive != 0) continue;
    if (rule.within_count > 0 && (static_cast<std::int64_t>(rs.recent.size()) < rule.within_count ||
                                  rs.recent.front() <= step - rule.within_steps)) {
      continue;
    }
    if (rs.last_fired > 0 && step <= rs.last_fired + rule.cooldown) continue;
    rs.last_fired = step;
    ++rs.fired;
    fired->push_back(&rule);
  }
}

double PolicyEngine::clip_target(const ActionSpec& spec) const {
  const double z = spec.z > 0 ? spec.z : config_.detectors.grad_norm_spike.ema.threshold;
  return state_.grad_norm_ema.mean + z * std::sqrt(state_.grad_norm_ema.variance);
}

Verdict PolicyEngine::evaluate(const StepInput& input) {
  Verdict v;
  Signals& signals = v.signals;
  detect(input, &signals);
  detect_trends(input, &signals);
  std::vector<const Rule*> fired;
  run_rules(input.step, signals, &fired);

  ActionSet actions;
  std::vector<std::string> names;
  for (const Rule* r : fired) {
    actions.add(r->action, r->action.type == Action::kClip ? clip_target(r->action) : 0.0);
    names.push_back(r->name);
  }
  std::ostringstream detail;
  const bool nonfinite = input.stats.nonfinite();
  // Replicas that disagree on the guard's own state cannot be trusted to agree on anything.
  if (signals.has(Signal::kRankDesync)) actions.add(Action::kAbort);
  describe_signals(signals, input.stats, input.step, state_.watch, detail);
  if (signals.has(Signal::kConsecutiveLimit)) {
    actions.add(Action::kAbort);
    names.push_back("limits.max_consecutive_bad_steps");
    detail << " (" << signals.consecutive_bad_steps << " bad steps in a row, limit "
           << config_.limits.max_consecutive_bad_steps << ")";
  }
  // A NaN/Inf step is never applied, whatever the rules say (or while they cool down).
  if (nonfinite && actions.outcome_so_far() == Outcome::kApplied) actions.add(Action::kSkipBatch);
  // A signal no rule acted on is still recorded and exported.
  if (signals.any() && fired.empty() && !nonfinite && !actions.has(Action::kAbort)) {
    actions.add(Action::kAlert);
  }

  // Limits see the outcome the rules chose.
  const Limits& limits = config_.limits;
  if (limits.max_skips.enabled && actions.outcome_so_far() == Outcome::kSkipped &&
      budget_spent(limits.max_skips, input.step, &state_.recent_skips)) {
    signals.raised.push_back(Signal::kSkipBudget);
    actions.add(limits.max_skips.action, 0.0);
    names.push_back("limits.max_skips");
    detail << " (more than " << limits.max_skips.count << " skips within "
           << limits.max_skips.window << " steps)";
  }
  if (limits.loss_scale_floor_steps > 0 && input.loss_scale_steps_at_floor > 0 &&
      input.loss_scale_steps_at_floor % limits.loss_scale_floor_steps == 0) {
    signals.raised.push_back(Signal::kLossScaleFloor);
    actions.add(limits.loss_scale_floor_action, 0.0);
    names.push_back("limits.loss_scale_floor");
    detail << " (loss scale at its floor for " << input.loss_scale_steps_at_floor << " steps)";
  }
  if (limits.max_rollbacks.enabled && actions.outcome_so_far() == Outcome::kRolledBack &&
      budget_spent(limits.max_rollbacks, input.step, &state_.recent_rollbacks)) {
    signals.raised.push_back(Signal::kRollbackBudget);
    actions.add(limits.max_rollbacks.action, 0.0);
    names.push_back("limits.max_rollbacks");
    detail << " (more than " << limits.max_rollbacks.count << " rollbacks within "
           << limits.max_rollbacks.window << " steps)";
  }

  v.decision = actions.finish();
  v.decision.rules = std::move(names);
  if (signals.any()) v.decision.reason = decision_reason(signals, detail.str(), v.decision.rules);
  return v;
}

}  // namespace policy
}  // namespace stepguard
