#include "csrc/policy/policy.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace stepguard {
namespace policy {

PolicyEngine::PolicyEngine(PolicyConfig config) : config_(config) {
  TORCH_CHECK(config_.max_consecutive_bad_steps >= 0,
              "stepguard: max_consecutive_bad_steps must be >= 0, got ",
              config_.max_consecutive_bad_steps);
}

Signals PolicyEngine::detect(const GlobalStats& stats) {
  Signals signals;
  // The loss comes first: a non-finite loss makes every gradient non-finite, not the reverse.
  if (stats.loss_nonfinite_ranks > 0) signals.raised.push_back(Signal::kNonfiniteLoss);
  if (stats.nonfinite_count() > 0) signals.raised.push_back(Signal::kNonfiniteGrad);
  if (!stats.desynced_ranks.empty()) {
    signals.raised.push_back(Signal::kRankDesync);
    signals.desynced_ranks = stats.desynced_ranks;
  }
  if (signals.any()) {
    ++state_.consecutive_bad_steps;
    ++state_.bad_steps_total;
  } else {
    state_.consecutive_bad_steps = 0;
  }
  signals.consecutive_bad_steps = state_.consecutive_bad_steps;
  if (config_.max_consecutive_bad_steps > 0 &&
      state_.consecutive_bad_steps >= config_.max_consecutive_bad_steps) {
    signals.raised.push_back(Signal::kConsecutiveLimit);
  }
  return signals;
}

Decision PolicyEngine::decide(const Signals& signals) const {
  Decision decision;
  if (!signals.any()) {
    decision.outcome = Outcome::kApplied;
    decision.actions = {Action::kApply};
    return decision;
  }
  std::ostringstream reason;
  for (std::size_t i = 0; i < signals.raised.size(); ++i) {
    reason << (i ? ", " : "") << to_string(signals.raised[i]);
  }
  if (signals.has(Signal::kRankDesync)) {
    // Replicas that disagree on the guard's own state cannot be trusted to agree on anything.
    decision.outcome = Outcome::kAborted;
    decision.actions = {Action::kAbort};
    reason << " (rank";
    if (signals.desynced_ranks.size() > 1) reason << "s";
    for (std::size_t i = 0; i < signals.desynced_ranks.size(); ++i) {
      reason << (i ? ", " : " ") << signals.desynced_ranks[i];
    }
    reason << " diverged: guard state differs from the other ranks)";
  } else if (signals.has(Signal::kConsecutiveLimit)) {
    decision.outcome = Outcome::kAborted;
    decision.actions = {Action::kAbort};
    reason << " (" << signals.consecutive_bad_steps << " bad steps in a row, limit "
           << config_.max_consecutive_bad_steps << ")";
  } else {
    decision.outcome = Outcome::kSkipped;
    decision.actions = {Action::kSkipBatch};
  }
  decision.reason = reason.str();
  return decision;
}

}  // namespace policy
}  // namespace stepguard
