#include "csrc/policy/detectors.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace stepguard {
namespace policy {

EmaZScore::EmaZScore(EmaZScoreConfig config) : config_(config) {
  if (!(config_.threshold > 0)) throw std::invalid_argument("stepguard: z threshold must be > 0");
  if (config_.warmup < 0) throw std::invalid_argument("stepguard: warmup must be >= 0");
  if (!(config_.decay > 0 && config_.decay < 1)) {
    throw std::invalid_argument("stepguard: decay must be in (0, 1)");
  }
}

SpikeVerdict EmaZScore::observe(double x) {
  SpikeVerdict v;
  if (!std::isfinite(x)) return v;
  if (state_.count > 0) {
    const double sd = std::sqrt(state_.variance);
    const double diff = x - state_.mean;
    // A constant series has no spread: any rise is infinitely many deviations away.
    v.z = sd > 0 ? diff / sd : (diff > 0 ? std::numeric_limits<double>::infinity() : 0.0);
    v.spike = state_.count >= config_.warmup && v.z > config_.threshold;
  }
  if (v.spike) return v;  // spiky values do not update the averages
  if (state_.count == 0) {
    state_.mean = x;
    state_.variance = 0.0;
  } else {
    const double alpha = 1.0 - config_.decay;
    const double delta = x - state_.mean;
    state_.mean += alpha * delta;
    state_.variance = (1.0 - alpha) * (state_.variance + alpha * delta * delta);
  }
  state_.count += 1;
  return v;
}

RatioRule::RatioRule(RatioRuleConfig config) : config_(config) {
  if (!(config_.factor > 1)) throw std::invalid_argument("stepguard: ratio factor must be > 1");
  if (config_.reference_steps < 1) {
    throw std::invalid_argument("stepguard: reference_steps must be >= 1");
  }
}

bool RatioRule::observe(double x) {
  if (!std::isfinite(x)) return false;
  if (state_.count < config_.reference_steps) {
    state_.reference_max = state_.count == 0 ? x : std::max(state_.reference_max, x);
    state_.count += 1;
    return false;
  }
  return x > config_.factor * state_.reference_max;
}

}  // namespace policy
}  // namespace stepguard
