#include "csrc/scaling/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "csrc/common/bits.h"

namespace stepguard {
namespace scaling {

namespace {
void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("stepguard: loss_scale: " + what);
}
}  // namespace

LossScaler::LossScaler(LossScalerConfig config) : config_(config) {
  require(std::isfinite(config_.init_scale) && config_.init_scale > 0,
          "init_scale must be finite and > 0");
  require(config_.growth_factor > 1 && std::isfinite(config_.growth_factor),
          "growth_factor must be > 1");
  require(config_.backoff_factor > 0 && config_.backoff_factor < 1,
          "backoff_factor must be in (0, 1)");
  require(config_.growth_interval >= 1, "growth_interval must be >= 1");
  require(config_.hysteresis >= 1, "hysteresis must be >= 1");
  require(config_.min_scale >= 0 && std::isfinite(config_.min_scale), "min_scale must be >= 0");
  require(config_.max_scale > 0, "max_scale must be > 0");
  require(config_.min_scale <= kMaxUsableScale && config_.max_scale >= kMinUsableScale,
          "min_scale and max_scale must leave scales in [2^-126, 2^126], where the scale and its "
          "inverse are finite fp32 numbers");
  require(config_.init_scale >= floor() && config_.init_scale <= ceiling(),
          "init_scale must lie between min_scale and max_scale, and in [2^-126, 2^126]");
  state_.scale = config_.init_scale;
  state_.hysteresis_left = config_.hysteresis;
}

double LossScaler::floor() const noexcept { return std::max(config_.min_scale, kMinUsableScale); }

double LossScaler::ceiling() const noexcept { return std::min(config_.max_scale, kMaxUsableScale); }

void LossScaler::set_scale(double scale) {
  state_.scale = std::min(std::max(scale, floor()), ceiling());
}

void LossScaler::check(const LossScalerState& s) const {
  // The counters' bounds are the ones update() keeps: a tracker at or past the interval would
  // never grow the scale again, a hysteresis above the config's would tolerate more overflows.
  require(std::isfinite(s.scale) && s.scale >= floor() && s.scale <= ceiling(),
          "the saved scale " + std::to_string(s.scale) + " is not in [" + std::to_string(floor()) +
              ", " + std::to_string(ceiling()) + "], the scales this scaler uses");
  require(s.growth_tracker >= 0 && s.growth_tracker < config_.growth_interval,
          "the saved growth tracker " + std::to_string(s.growth_tracker) + " is not in [0, " +
              std::to_string(config_.growth_interval) + ")");
  require(s.hysteresis_left >= 0 && s.hysteresis_left <= config_.hysteresis,
          "the saved hysteresis " + std::to_string(s.hysteresis_left) + " is not in [0, " +
              std::to_string(config_.hysteresis) + "]");
  require(s.steps_at_floor >= 0 && s.steps_at_floor <= kMaxDecodedCount,
          "the saved count of steps at the floor " + std::to_string(s.steps_at_floor) +
              " is not in [0, 2^52]");
}

void LossScaler::restore(const LossScalerState& state) {
  check(state);
  state_ = state;
}

void LossScaler::update(bool nonfinite) {
  if (nonfinite) {
    state_.growth_tracker = 0;
    // At 0 every further overflow backs off; the tracker stays there until the next growth.
    state_.hysteresis_left = std::max<std::int64_t>(0, state_.hysteresis_left - 1);
    if (state_.hysteresis_left <= 0) set_scale(state_.scale * config_.backoff_factor);
  } else {
    state_.growth_tracker += 1;
    if (state_.growth_tracker == config_.growth_interval) {
      state_.growth_tracker = 0;
      state_.hysteresis_left = config_.hysteresis;
      const double grown = state_.scale * config_.growth_factor;
      if (std::isfinite(grown)) set_scale(grown);
    }
  }
  state_.steps_at_floor = at_floor() ? state_.steps_at_floor + 1 : 0;
}

void LossScaler::drop(double factor) {
  require(factor > 0 && factor < 1, "drop factor must be in (0, 1)");
  set_scale(state_.scale * factor);
  state_.growth_tracker = 0;
}

}  // namespace scaling
}  // namespace stepguard
