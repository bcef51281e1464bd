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
  if (!(config_.recent_factor == 0 || config_.recent_factor > 1)) {
    throw std::invalid_argument("stepguard: recent_factor must be 0 (off) or > 1");
  }
  if (config_.recent_window < static_cast<std::int64_t>(kRecentMinimum) ||
      config_.recent_window > 1024) {
    throw std::invalid_argument("stepguard: recent_window must be in [2, 1024]");
  }
}

double recent_median(const std::vector<double>& values) {
  if (values.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::vector<double> v = values;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

bool rose_above(double x, double reference, double scale, double factor) {
  if (reference > 0) return x > factor * reference;
  const double s = std::max(std::abs(reference), scale);
  return s > 0 && x - reference > (factor - 1.0) * s;
}

namespace {

// The warm-up's gross rise: x above early_factor times its mean (a series at or below zero:
// against its magnitude or spread, see rose_above).
bool early_jump(double x, const EmaZScoreState& s, double factor) {
  return rose_above(x, s.mean, std::sqrt(s.variance), factor);
}

// The recent ratio: x above factor times the recent median, and beyond the window's own scatter,
// so that a series noisy by nature does not alarm: its rise over the median is more than factor
// times the largest rise between neighbours in the window (0 for a series that only fell), and
// for a positive series its log-ratio to the median is more than kRecentScatter times the
// window's largest log-deviation from the median.

bool recent_jump(double x, const std::vector<double>& recent, double factor, double* reference) {
  if (recent.size() < kRecentMinimum) return false;
  const double median = recent_median(recent);
  double largest_rise = 0.0;
  double lo = recent.front();
  double hi = recent.front();
  for (std::size_t i = 1; i < recent.size(); ++i) {
    largest_rise = std::max(largest_rise, recent[i] - recent[i - 1]);
    lo = std::min(lo, recent[i]);
    hi = std::max(hi, recent[i]);
  }
  if (!rose_above(x, median, hi - lo, factor) || !(x - median > factor * largest_rise))
    return false;
  if (median > 0 && lo > 0) {
    const double scatter = std::max(std::log(hi / median), std::log(median / lo));
    if (!(std::log(x / median) > kRecentScatter * scatter)) return false;
  }
  *reference = median;
  return true;
}

}  // namespace

SpikeVerdict EmaZScore::observe(double x, double largest) {
  SpikeVerdict v;
  if (!std::isfinite(x)) return v;
  v.reference = state_.mean;
  const double judged = std::isfinite(largest) && largest > x ? largest : x;
  double median = 0.0;
  if (config_.recent_factor > 0 &&
      recent_jump(judged, state_.recent, config_.recent_factor, &median)) {
    v.spike = v.recent = true;
    v.reference = median;
  }
  // Detrended once two values are in: the centre is their median, the spread its own average.
  const bool detrended = config_.detrend && state_.recent.size() >= kRecentMinimum;
  const double centre = detrended ? recent_median(state_.recent) : state_.mean;
  if (detrended && !v.recent) v.reference = centre;
  if (state_.count > 0) {
    const double sd = std::sqrt(detrended ? state_.spread : state_.variance);
    const double diff = x - centre;
    // A constant series has no spread: any rise is infinitely many deviations away.
    v.z = sd > 0 ? diff / sd : (diff > 0 ? std::numeric_limits<double>::infinity() : 0.0);
    if (v.spike) {
      // caught by the recent ratio already
    } else if (state_.count >= config_.warmup) {
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
  if (detrended) {  // bias-corrected the same way, from its first deviation (the third value)
    const auto seen = static_cast<double>(state_.count - static_cast<std::int64_t>(kRecentMinimum));
    const double alpha = std::max(1.0 - config_.decay, 1.0 / (std::max(seen, 0.0) + 1.0));
    const double e = x - centre;
    state_.spread = (1.0 - alpha) * state_.spread + alpha * e * e;
  }
  state_.count += 1;
  if (config_.recent_factor > 0 || config_.detrend) {
    state_.recent.push_back(x);
    const auto keep = static_cast<std::size_t>(config_.recent_window);
    if (state_.recent.size() > keep) {
      state_.recent.erase(state_.recent.begin(),
                          state_.recent.end() - static_cast<std::ptrdiff_t>(keep));
    }
  }
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
