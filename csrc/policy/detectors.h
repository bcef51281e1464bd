/*
 * Spike detectors on a scalar series (the loss or the grad norm), fed the agreed global value once
 * per step, so every rank sees the same verdict:
 * - EmaZScore: z = (x - EMA mean) / EMA std, a spike when z > threshold after a warm-up; a spiky
 *   value does not update the averages, so one spike cannot hide the next. The averages are
 *   bias-corrected (the plain mean and variance until 1 / (1 - decay) values are in), and during
 *   the warm-up a gross rise is caught by a ratio instead: x > early_factor * the running mean
 *   once early_after values are in (for a series at or below zero: a rise of (early_factor - 1)
 *   times its magnitude or spread), so a run that blows up in its first steps is not waved
 *   through while the z-score warms up.
 * - RatioRule (Megatron's check): x > k * the largest value seen in the first N steps.
 * Non-finite values are the non-finite detector's business: they are ignored here.
 *
 * Deterministic; state is a plain value. Not thread-safe.
 */
#pragma once

#include <cstdint>

namespace stepguard {
namespace policy {

struct EmaZScoreConfig {
  double threshold = 6.0;
  std::int64_t warmup = 100;     ///< observations before a spike can be reported
  double decay = 0.99;           ///< EMA decay per observation (alpha = 1 - decay)
  double early_factor = 10.0;    ///< during the warm-up: a spike above this x the mean; 0: off
  std::int64_t early_after = 3;  ///< observations before the early ratio applies
};

struct EmaZScoreState {
  double mean = 0.0;
  double variance = 0.0;
  std::int64_t count = 0;  ///< observations folded into the averages
  bool operator==(const EmaZScoreState& o) const noexcept {
    return mean == o.mean && variance == o.variance && count == o.count;
  }
};

struct SpikeVerdict {
  bool spike = false;
  double z = 0.0;      ///< 0 before the first observation or when the series is constant
  bool early = false;  ///< caught by the warm-up ratio (x / mean > early_factor), not by z
};

class EmaZScore {
 public:
  /// Throws std::invalid_argument naming the field.
  explicit EmaZScore(EmaZScoreConfig config = {});
  SpikeVerdict observe(double x);
  const EmaZScoreState& state() const noexcept { return state_; }
  void restore(const EmaZScoreState& s) { state_ = s; }

 private:
  EmaZScoreConfig config_;
  EmaZScoreState state_;
};

struct RatioRuleConfig {
  double factor = 10.0;                ///< k
  std::int64_t reference_steps = 100;  ///< N: the first N finite values set the reference
};

struct RatioRuleState {
  double reference_max = 0.0;
  std::int64_t count = 0;
  bool operator==(const RatioRuleState& o) const noexcept {
    return reference_max == o.reference_max && count == o.count;
  }
};

class RatioRule {
 public:
  explicit RatioRule(RatioRuleConfig config = {});
  /// True when x exceeds factor * the reference maximum (only after the reference steps).
  bool observe(double x);
  const RatioRuleState& state() const noexcept { return state_; }
  void restore(const RatioRuleState& s) { state_ = s; }

 private:
  RatioRuleConfig config_;
  RatioRuleState state_;
};

}  // namespace policy
}  // namespace stepguard
