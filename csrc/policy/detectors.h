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
 *   At any step (recent_factor > 0), from the third value on: a spike when x is more than
 *   recent_factor times the median of the last recent_window accepted values and its rise over
 *   that median is more than recent_factor times the largest step-to-step rise inside the window.
 *   The median follows a loss that is still falling fast (a running mean lags above it); the rise
 *   condition keeps a series that is noisy by nature (a small, jumpy loss) from alarming.
 *   Detrended (detrend = true): z = (x - the recent median) / its spread, the spread being the EMA
 *   of the squared deviations of the accepted values from the median of the values before each.
 *   The median follows a loss that is still falling, so neither the centre nor the spread carries
 *   the descent: the plain EMA's mean lags above a falling loss and its variance takes in that lag,
 *   which blunts the z-score for as long as the loss falls (a loss had to triple to be told there).
 *   The warm-up, the early ratio and the recent ratio are the same; the EMA mean and variance are
 *   kept either way (the grad norm's clip threshold reads them).
 * - RatioRule (Megatron's check): x > k * the largest value seen in the first N steps.
 * Non-finite values are the non-finite detector's business: they are ignored here.
 *
 * Deterministic; state is a plain value. Not thread-safe.
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace stepguard {
namespace policy {

struct EmaZScoreConfig {
  double threshold = 6.0;
  std::int64_t warmup = 100;       ///< observations before a spike can be reported
  double decay = 0.99;             ///< EMA decay per observation (alpha = 1 - decay)
  double early_factor = 10.0;      ///< during the warm-up: a spike above this x the mean; 0: off
  std::int64_t early_after = 3;    ///< observations before the early ratio applies
  double recent_factor = 0.0;      ///< at any step: a spike above this x the recent median; 0: off
  std::int64_t recent_window = 8;  ///< accepted values the recent median is taken over (>= 2)
  bool detrend = false;            ///< z against the recent median and its own spread
};

/// Values a recent-ratio test needs before it applies: the third value is the first it judges.
constexpr std::size_t kRecentMinimum = 2;
/// A recent spike's log-ratio to the median must exceed this many times the window's largest
/// log-deviation from its median (the window's own scatter).
constexpr double kRecentScatter = 3.0;

struct EmaZScoreState {
  double mean = 0.0;
  double variance = 0.0;
  std::int64_t count = 0;      ///< observations folded into the averages
  std::vector<double> recent;  ///< the last recent_window accepted values, newest last
  double spread = 0.0;         ///< detrended: EMA of (x - median of the values before x)^2
  bool operator==(const EmaZScoreState& o) const noexcept {
    return mean == o.mean && variance == o.variance && count == o.count && recent == o.recent &&
           spread == o.spread;
  }
};

struct SpikeVerdict {
  bool spike = false;
  double z = 0.0;          ///< 0 before the first observation or when the series is constant
  bool early = false;      ///< caught by the warm-up ratio (x / mean > early_factor), not by z
  bool recent = false;     ///< caught by the recent ratio (x / recent median > recent_factor)
  double reference = 0.0;  ///< the level x was judged against: the recent median, else the mean
                           ///< (detrended: the recent median)
};

/// The level a series rose from: the upper median of `values` (NaN when empty).
double recent_median(const std::vector<double>& values);
/// Whether x rose `factor` times above `reference`: x > factor * reference for a positive
/// reference; for a reference at or below zero, a rise of (factor - 1) times `scale` (its
/// magnitude or spread), as a ratio has no meaning there.
bool rose_above(double x, double reference, double scale, double factor);

class EmaZScore {
 public:
  /// Throws std::invalid_argument naming the field.
  explicit EmaZScore(EmaZScoreConfig config = {});
  /// `largest`: the largest of the values x is the mean of (one rank's loss), judged by the recent
  /// ratio alone; NaN or below x: x itself.
  SpikeVerdict observe(double x, double largest = std::numeric_limits<double>::quiet_NaN());
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
