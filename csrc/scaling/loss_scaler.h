/*
 * Dynamic loss scaling for fp16: the one owner of the loss scale. The update rule is PyTorch
 * GradScaler's (back off on a non-finite step, grow after `growth_interval` clean steps), with
 * Megatron/DeepSpeed's optional hysteresis (back off only after `hysteresis` non-finite steps) and
 * a floor. At the floor the scaler does not throw, as DeepSpeed does ("Current loss scale already
 * at minimum"): it counts the steps spent there and the policy decides.
 *
 * Torch-free and deterministic; its state is a plain value for snapshots and digests.
 * Not thread-safe.
 */
#pragma once

#include <cstdint>
#include <limits>

namespace stepguard {
namespace scaling {

/// The scales the guard ever uses: both the scale and its inverse are finite, normal fp32 numbers
/// (the loss is multiplied by the scale and the gradients by the inverse in fp32). Below 2^-126
/// the inverse overflows fp32 (1/scale is Inf and the unscaled gradients NaN), so the scale stops
/// at this floor whatever the config says (GradScaler's rule alone has none); the policy then
/// sees an overflow the scale cannot fix.
constexpr double kMinUsableScale = 1.1754943508222875e-38;  // 2^-126
constexpr double kMaxUsableScale = 8.507059173023462e+37;   // 2^126

struct LossScalerConfig {
  double init_scale = 65536.0;  ///< 2^16, as GradScaler
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  std::int64_t hysteresis = 1;  ///< non-finite steps tolerated before backing off (Megatron: 2)
  double min_scale = 0.0;  ///< floor; 0 = none but kMinUsableScale (GradScaler: none; Megatron: 1)
  double max_scale = std::numeric_limits<double>::infinity();
};

struct LossScalerState {
  double scale = 65536.0;
  std::int64_t growth_tracker = 0;  ///< clean steps since the last change
  std::int64_t hysteresis_left = 1;
  std::int64_t steps_at_floor = 0;  ///< consecutive updates that ended at the floor
  bool operator==(const LossScalerState& o) const noexcept {
    return scale == o.scale && growth_tracker == o.growth_tracker &&
           hysteresis_left == o.hysteresis_left && steps_at_floor == o.steps_at_floor;
  }
};

class LossScaler {
 public:
  /// Throws std::invalid_argument naming the field when the config is out of range.
  explicit LossScaler(LossScalerConfig config = {});

  /// After a step: `nonfinite` says whether any gradient (on any rank) overflowed.
  void update(bool nonfinite);
  /// The policy's drop_loss_scale action: scale *= factor (0 < factor < 1), not below the floor;
  /// restarts the growth count.
  void drop(double factor);

  double scale() const noexcept { return state_.scale; }
  double inv_scale() const noexcept { return 1.0 / state_.scale; }
  /// The lowest scale this scaler reaches: the config's floor, never below kMinUsableScale.
  double floor() const noexcept;
  /// The highest: the config's ceiling, never above kMaxUsableScale.
  double ceiling() const noexcept;
  bool at_floor() const noexcept { return state_.scale <= floor(); }
  const LossScalerConfig& config() const noexcept { return config_; }
  const LossScalerState& state() const noexcept { return state_; }
  /// Throws std::invalid_argument naming the field when `state` is not one this scaler can reach
  /// (a scale outside [floor(), ceiling()], counters outside their bounds); changes nothing.
  void check(const LossScalerState& state) const;
  /// check(), then takes `state`.
  void restore(const LossScalerState& state);

 private:
  void set_scale(double scale);

  LossScalerConfig config_;
  LossScalerState state_;
};

}  // namespace scaling
}  // namespace stepguard
