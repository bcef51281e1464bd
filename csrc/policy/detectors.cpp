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
  if (!(config_.early_factor == 0 || config_.early_factor > 1)) {
    throw std::invalid_argument("stepguard: early_factor must be 0 (off) or > 1");
  }
  if (config_.early_after < 1) throw std::invalid_argument("stepguard: early_after must be >= 1");
}

namespace {

// The warm-up's gross rise. A positive series: x above early_factor times its mean. A series at
// or below zero (log-likelihoods with an offset, RL objectives) has no such ratio: the same rise,
// (early_factor - 1) times its level, is measured against its magnitude or its spread.
bool early_jump(double x, const EmaZScoreState& s, double factor) {
  if (s.mean > 0) return x > factor * s.mean;
  const double scale = std::max(std::abs(s.mean), std::sqrt(s.variance));
  return scale > 0 && x - s.mean > (factor - 1.0) * scale;
}

}  // namespace

SpikeVerdict EmaZScore::observe(double x) {
  SpikeVerdict v;
  if (!std::isfinite(x)) return v;
  if (state_.count > 0) {
    const double sd = std::sqrt(state_.variance);
    const double diff = x - state_.mean;
    // A constant series has no spread: any rise is infinitely many deviations away.
    v.z = sd > 0 ? diff / sd : (diff > 0 ? std::numeric_limits<double>::infinity() : 0.0);
    if (state_.count >= config_.warmup) {
      v.spike = v.z > config_.threshold;
    } else if (config_.early_factor > 0 && state_.count >= config_.early_after &&
               early_jump(x, state_, config_.early_factor)) {
      v.spike = v.early = true;
    }
  }
  if (v.spike) return v;  // spiky values do not update the averages
  if (state_.count == 0) {
    state_.mean = x;
    state_.variance = 0.0;
  } else {
    // Bias-corrected: the plain running mean and variance until 1 / alpha values are in, so the
    // first value does not dominate the level the warm-up ratio and the z-score start from.
    const double alpha = std::max(1.0 - config_.decay, 1.0 / static_cast<double>(state_.count + 1));
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
