#include "csrc/policy/policy.h"

#include "csrc/common/bits.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
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
  static constexpr int kCount = static_cast<int>(Action::kAlert) + 1;
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

std::string signal_list(const Signals& signals) {
  std::string out;
  for (Signal s : signals.raised) out += (out.empty() ? "" : ", ") + std::string(to_string(s));
  return out;
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

std::vector<std::int64_t> EngineState::encode() const {
  std::vector<std::int64_t> w = {consecutive_bad_steps,
                                 bad_steps_total,
                                 bits_of(loss_ema.mean),
                                 bits_of(loss_ema.variance),
                                 loss_ema.count,
                                 bits_of(grad_norm_ema.mean),
                                 bits_of(grad_norm_ema.variance),
                                 grad_norm_ema.count,
                                 bits_of(loss_ratio.reference_max),
                                 loss_ratio.count,
                                 static_cast<std::int64_t>(rules.size())};
  auto list = [&w](const std::vector<std::int64_t>& v) {
    w.push_back(static_cast<std::int64_t>(v.size()));
    w.insert(w.end(), v.begin(), v.end());
  };
  for (const RuleState& r : rules) {
    w.push_back(r.streak);
    w.push_back(r.last_fired);
    w.push_back(r.fired);
    list(r.recent);
  }
  list(recent_skips);
  list(recent_rollbacks);
  return w;
}

EngineState EngineState::decode(const std::vector<std::int64_t>& words, std::size_t rule_count) {
  std::size_t at = 0;
  auto next = [&]() -> std::int64_t {
    if (at >= words.size()) throw std::invalid_argument("stepguard: policy state is truncated");
    return words[at++];
  };
  auto list = [&](std::vector<std::int64_t>* v) {
    const std::int64_t n = next();
    if (n < 0 || static_cast<std::size_t>(n) > words.size() - at) {
      throw std::invalid_argument("stepguard: policy state holds a bad list length");
    }
    v->assign(words.begin() + static_cast<std::ptrdiff_t>(at),
              words.begin() + static_cast<std::ptrdiff_t>(at + static_cast<std::size_t>(n)));
    at += static_cast<std::size_t>(n);
  };
  EngineState s;
  s.consecutive_bad_steps = next();
  s.bad_steps_total = next();
  s.loss_ema.mean = double_of(next());
  s.loss_ema.variance = double_of(next());
  s.loss_ema.count = next();
  s.grad_norm_ema.mean = double_of(next());
  s.grad_norm_ema.variance = double_of(next());
  s.grad_norm_ema.count = next();
  s.loss_ratio.reference_max = double_of(next());
  s.loss_ratio.count = next();
  const std::int64_t n = next();
  if (n != static_cast<std::int64_t>(rule_count)) {
    throw std::invalid_argument("stepguard: policy state holds " + std::to_string(n) +
                                " rules, the policy has " + std::to_string(rule_count));
  }
  s.rules.resize(rule_count);
  for (RuleState& r : s.rules) {
    r.streak = next();
    r.last_fired = next();
    r.fired = next();
    list(&r.recent);
  }
  list(&s.recent_skips);
  list(&s.recent_rollbacks);
  if (at != words.size()) throw std::invalid_argument("stepguard: policy state has extra words");
  s.check_ranges();
  return s;
}

namespace {

// Far beyond any run, far inside int64 and exact in a double: counts and steps stay below it.
constexpr std::int64_t kMaxCount = std::int64_t{1} << 52;

void check_count(const char* what, std::int64_t v) {
  if (v < 0 || v > kMaxCount) {
    throw std::invalid_argument(std::string("stepguard: policy state holds ") + what + " " +
                                std::to_string(v) + ", not in [0, 2^52]");
  }
}

void check_ema(const char* what, const EmaZScoreState& e) {
  check_count(what, e.count);
  if (!std::isfinite(e.mean) || !std::isfinite(e.variance) || e.variance < 0) {
    throw std::invalid_argument(std::string("stepguard: policy state holds a ") + what +
                                " average that is not a finite number (mean " +
                                std::to_string(e.mean) + ", variance " +
                                std::to_string(e.variance) + ")");
  }
}

}  // namespace

void EngineState::check_ranges() const {
  check_count("consecutive_bad_steps", consecutive_bad_steps);
  check_count("bad_steps_total", bad_steps_total);
  check_ema("loss", loss_ema);
  check_ema("grad_norm", grad_norm_ema);
  check_count("a loss_ratio count", loss_ratio.count);
  if (loss_ratio.count > 0 && !std::isfinite(loss_ratio.reference_max)) {
    throw std::invalid_argument(
        "stepguard: policy state holds a loss_ratio reference that is not "
        "a finite number");
  }
  for (const RuleState& r : rules) {
    check_count("a rule streak", r.streak);
    check_count("a rule's last firing step", r.last_fired);
    check_count("a rule's firing count", r.fired);
    for (std::int64_t step : r.recent) check_count("a rule's recent step", step);
  }
  for (std::int64_t step : recent_skips) check_count("a recent skip's step", step);
  for (std::int64_t step : recent_rollbacks) check_count("a recent rollback's step", step);
}

void EngineState::check_not_after(std::int64_t step) const {
  const auto after = [step](const char* what, std::int64_t at) {
    if (at > step) {
      throw std::invalid_argument(std::string("stepguard: policy state holds ") + what + " " +
                                  std::to_string(at) + ", after its own step " +
                                  std::to_string(step));
    }
  };
  for (const RuleState& r : rules) {
    after("a rule's last firing at step", r.last_fired);
    for (std::int64_t at : r.recent) after("a rule's recent firing at step", at);
  }
  for (std::int64_t at : recent_skips) after("a skip at step", at);
  for (std::int64_t at : recent_rollbacks) after("a rollback at step", at);
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
}

void PolicyEngine::restore(const EngineState& state) {
  if (state.rules.size() != config_.rules.size()) {
    throw std::invalid_argument("stepguard: restored policy state holds " +
                                std::to_string(state.rules.size()) + " rules, the policy has " +
                                std::to_string(config_.rules.size()));
  }
  state_ = state;
}

void PolicyEngine::restore_detectors(const EngineState& state) {
  state_.loss_ema = state.loss_ema;
  state_.grad_norm_ema = state.grad_norm_ema;
  state_.loss_ratio = state.loss_ratio;
}

void PolicyEngine::detect(const StepInput& input, Signals* signals) {
  const GlobalStats& stats = input.stats;
  // The loss comes first: a non-finite loss makes every gradient non-finite, not the reverse.
  if (stats.loss_nonfinite_ranks > 0) signals->raised.push_back(Signal::kNonfiniteLoss);
  if (stats.nonfinite_count() > 0) signals->raised.push_back(Signal::kNonfiniteGrad);
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
  // Value detectors see only values that mean something: a finite loss from every rank, and a
  // grad norm over gradients that are all finite.
  const DetectorSettings& d = config_.detectors;
  if (stats.loss_nonfinite_ranks == 0 && std::isfinite(stats.loss)) {
    if (d.loss_spike.enabled) {
      loss_spike_.restore(state_.loss_ema);
      if (loss_spike_.observe(stats.loss).spike) signals->raised.push_back(Signal::kLossSpike);
      state_.loss_ema = loss_spike_.state();
    }
    if (d.loss_ratio.enabled) {
      loss_ratio_.restore(state_.loss_ratio);
      if (loss_ratio_.observe(stats.loss)) signals->raised.push_back(Signal::kLossRatio);
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
  if (signals.has(Signal::kRankDesync)) {
    // Replicas that disagree on the guard's own state cannot be trusted to agree on anything.
    actions.add(Action::kAbort);
    detail << " (rank" << (signals.desynced_ranks.size() > 1 ? "s" : "");
    for (std::size_t i = 0; i < signals.desynced_ranks.size(); ++i) {
      detail << (i ? ", " : " ") << signals.desynced_ranks[i];
    }
    detail << " diverged: guard state differs from the other ranks)";
  }
  if (signals.has(Signal::kReplicaDivergence)) {
    detail << " (rank" << (signals.diverged_replicas.size() > 1 ? "s" : "");
    for (std::size_t i = 0; i < signals.diverged_replicas.size(); ++i) {
      detail << (i ? ", " : " ") << signals.diverged_replicas[i];
    }
    detail << ": parameters differ from the other replicas)";
  }
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
