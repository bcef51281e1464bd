// Spike detectors, with the averages worked out by hand (decay 0.5 keeps the numbers short).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "csrc/policy/detectors.h"

namespace stepguard {
namespace policy {
namespace {

TEST(EmaZScore, WarmsUpThenFlagsSpikesWithoutLearningFromThem) {
  EmaZScore d(EmaZScoreConfig{3.0, 2, 0.5});
  SpikeVerdict v = d.observe(10);  // first value: mean 10, variance 0
  EXPECT_FALSE(v.spike);
  EXPECT_EQ(d.state().mean, 10);
  v = d.observe(12);  // no spread yet, z = inf, but still warming up
  EXPECT_FALSE(v.spike);
  EXPECT_TRUE(std::isinf(v.z));
  EXPECT_EQ(d.state().mean, 11);     // 10 + 0.5 * 2
  EXPECT_EQ(d.state().variance, 1);  // 0.5 * (0 + 0.5 * 4)
  v = d.observe(11.5);               // z = 0.5 / 1
  EXPECT_FALSE(v.spike);
  EXPECT_EQ(v.z, 0.5);
  EXPECT_EQ(d.state().mean, 11.25);
  EXPECT_EQ(d.state().variance, 0.5625);  // 0.5 * (1 + 0.5 * 0.25)
  v = d.observe(20);                      // z = 8.75 / 0.75
  EXPECT_TRUE(v.spike);
  EXPECT_NEAR(v.z, 11.6666666667, 1e-9);
  EXPECT_EQ(d.state().mean, 11.25);  // the spike did not move the average
  EXPECT_EQ(d.state().count, 3);
  v = d.observe(std::numeric_limits<double>::quiet_NaN());
  EXPECT_FALSE(v.spike);
  EXPECT_EQ(d.state().count, 3);
}

TEST(EmaZScore, DefaultsAreZSixAfterAHundredSteps) {
  const EmaZScoreConfig c;
  EXPECT_EQ(c.threshold, 6.0);
  EXPECT_EQ(c.warmup, 100);
  EmaZScoreConfig no_early;
  no_early.early_factor = 0;
  EmaZScore d(no_early);
  for (int i = 0; i < 99; ++i) d.observe(1.0 + 0.01 * (i % 2));
  EXPECT_FALSE(d.observe(1e6).spike);  // the 100th value is still warm-up
  EXPECT_TRUE(d.observe(1e6).spike);
}

// A run that blows up in its first steps: the z-score is still warming up, the early ratio
// against the (bias-corrected) running mean catches the gross rise; ordinary early training
// (a falling loss, a noisy grad norm) raises nothing.
TEST(EmaZScore, GrossSpikesAreCaughtDuringTheWarmUp) {
  EmaZScore d;  // defaults: warm-up 100, early factor 10 after 3 values
  for (int i = 0; i < 59; ++i) {
    const double loss = 4.2 - 1.3 * i / 59.0 + 0.2 * ((i * 7) % 3 - 1);  // 4.2 falling to 2.9
    ASSERT_FALSE(d.observe(loss).spike) << i;
  }
  EXPECT_NEAR(d.state().mean, 3.55, 0.05);  // the plain mean, not the first value's weight
  const SpikeVerdict v = d.observe(56.9);   // the LR spike: 20x the current loss
  EXPECT_TRUE(v.spike);
  EXPECT_TRUE(v.early);
  EXPECT_EQ(d.state().count, 59);  // a spike does not move the level
  EXPECT_FALSE(d.observe(3.0).spike);

  // Before early_after values the level means nothing: nothing is flagged.
  EmaZScore fresh;
  EXPECT_FALSE(fresh.observe(1.0).spike);
  EXPECT_FALSE(fresh.observe(100.0).spike);
}

// A loss offset below zero (log-likelihoods, RL objectives): the early rise is measured against
// the series' magnitude or spread, as the ratio is for a positive one.
TEST(EmaZScore, GrossSpikesOfANegativeSeriesAreCaughtDuringTheWarmUp) {
  EmaZScore d;
  for (int i = 0; i < 20; ++i) {
    const double loss = -50.0 + 9.0 * i / 20.0 + 0.3 * ((i * 7) % 3 - 1);  // -50 rising to -41
    ASSERT_FALSE(d.observe(loss).spike) << i;
  }
  const SpikeVerdict v = d.observe(2991.0);
  EXPECT_TRUE(v.spike);
  EXPECT_TRUE(v.early);
  EXPECT_FALSE(d.observe(-40.0).spike);
  // Its ordinary noise, and a series around zero within its spread, are not spikes.
  EmaZScore around_zero;
  for (int i = 0; i < 10; ++i) {
    ASSERT_FALSE(around_zero.observe(i % 2 == 0 ? -0.5 : 0.5).spike) << i;
  }
  EXPECT_FALSE(around_zero.observe(2.0).spike);  // 2.5 above the mean: 5 spreads, under 9
  EXPECT_TRUE(around_zero.observe(20.0).spike);
}

TEST(RatioRule, FiresAboveKTimesTheEarlyMaximum) {
  RatioRule r(RatioRuleConfig{10.0, 3});
  EXPECT_FALSE(r.observe(5));
  EXPECT_FALSE(r.observe(3));
  EXPECT_FALSE(r.observe(4));
  EXPECT_EQ(r.state().reference_max, 5);
  EXPECT_FALSE(r.observe(49));
  EXPECT_TRUE(r.observe(51));
  EXPECT_FALSE(r.observe(std::numeric_limits<double>::infinity()));
}

// The recent ratio (recent_factor): from the third value on, at any step, against the median of
// the last values. It catches a 10x spike on a loss that is still falling fast, which the
// warm-up ratio against the running mean misses (the mean lags above a falling loss).
EmaZScoreConfig recent(double factor) {
  EmaZScoreConfig c;
  c.recent_factor = factor;
  return c;
}

TEST(EmaZScore, RecentRatioFiresFromTheThirdValue) {
  EmaZScore d(recent(5.0));
  EXPECT_FALSE(d.observe(2.0).spike);
  EXPECT_FALSE(d.observe(1.9).spike);      // one value is no level: nothing is judged yet
  const SpikeVerdict v = d.observe(10.5);  // the upper median of {2.0, 1.9} is 2.0; 10.5 > 10
  EXPECT_TRUE(v.spike);
  EXPECT_TRUE(v.recent);
  EXPECT_EQ(v.reference, 2.0);
  EXPECT_EQ(d.state().recent, (std::vector<double>{2.0, 1.9}));  // the spike is not learnt
  EXPECT_FALSE(d.observe(9.5).spike);                            // under 5x: accepted
  EXPECT_EQ(d.state().recent.size(), 3u);
}

TEST(EmaZScore, RecentRatioCatchesASpikeOnAFallingLossTheWarmUpRatioMisses) {
  EmaZScore with(recent(5.0));
  EmaZScore without;  // the defaults: early factor 10 against the running mean
  double last = 0.0;
  for (int t = 1; t <= 19; ++t) {
    last = 8.0 * std::exp(-0.25 * t) + 0.3;  // a loss falling fast, as in the first steps
    ASSERT_FALSE(with.observe(last).spike) << t;
    ASSERT_FALSE(without.observe(last).spike) << t;
  }
  EXPECT_GT(without.state().mean, last * 1.5);  // the mean lags far above the loss
  const SpikeVerdict v = with.observe(10.0 * last);
  EXPECT_TRUE(v.spike);
  EXPECT_TRUE(v.recent);
  EXPECT_FALSE(without.observe(10.0 * last).spike);  // 10x the loss, under 10x the mean
}

TEST(EmaZScore, RecentRatioStaysQuietOnASeriesThatIsNoisyByNature) {
  // A small, jumpy loss (log-normal, a spread of 30%: small-batch fine-tuning): a value 5x the
  // median of the last eight is rare but not unheard of; it is judged against the window's own
  // scatter. (The z-score is off here: on such a series its threshold is the user's to choose.)
  EmaZScoreConfig c = recent(5.0);
  c.threshold = 1e6;
  c.early_factor = 0.0;
  EmaZScore d(c);
  std::uint64_t state = 12345;
  const auto uniform = [&state] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (static_cast<double>(state >> 11) + 0.5) / 9007199254740992.0;
  };
  int spikes = 0;
  for (int i = 0; i < 20000; ++i) {
    const double gauss =
        std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform());
    spikes += d.observe(0.05 * std::exp(0.3 * gauss)).spike ? 1 : 0;
  }
  EXPECT_EQ(spikes, 0);
  EXPECT_TRUE(d.observe(10.0 * recent_median(d.state().recent)).spike);  // a real 10x still is
}

TEST(EmaZScore, RecentRatioJudgesTheLargestRankLossAndLearnsTheMean) {
  EmaZScore d(recent(5.0));
  for (int i = 0; i < 4; ++i) ASSERT_FALSE(d.observe(2.0, 2.0).spike);
  // Eight ranks, one at 20: the mean 4.25 is only about 2x, the largest rank's 10x.
  const SpikeVerdict v = d.observe(4.25, 20.0);
  EXPECT_TRUE(v.spike);
  EXPECT_EQ(d.state().recent, (std::vector<double>(4, 2.0)));
  EXPECT_FALSE(d.observe(2.1, 2.3).spike);
  EXPECT_EQ(d.state().recent.back(), 2.1);  // the mean is what the window holds
}

TEST(EmaZScore, RecentWindowKeepsItsLength) {
  EmaZScoreConfig c = recent(5.0);
  c.recent_window = 3;
  EmaZScore d(c);
  for (double x : {5.0, 4.0, 3.0, 2.0, 1.0}) ASSERT_FALSE(d.observe(x).spike);
  EXPECT_EQ(d.state().recent, (std::vector<double>{3.0, 2.0, 1.0}));
  EXPECT_TRUE(d.observe(20.0).spike);  // against the window: median 2, scatter log 2 (x 8)
}

TEST(EmaZScore, RecentRatioOnASeriesBelowZero) {
  EmaZScore d(recent(5.0));
  for (double x : {-1.0, -1.1, -0.9, -1.0}) ASSERT_FALSE(d.observe(x).spike);
  EmaZScore other = d;
  EXPECT_FALSE(d.observe(2.0).spike);     // a rise of 3 from the median -1: under 4x its size
  EXPECT_TRUE(other.observe(3.5).spike);  // a rise of 4.5
}

EmaZScoreConfig detrended() {
  EmaZScoreConfig c;  // the defaults: z 6 after 100 steps, decay 0.99
  c.detrend = true;
  return c;
}

TEST(EmaZScore, DetrendedZIsTakenAgainstTheRecentMedianAndItsOwnSpread) {
  EmaZScoreConfig c{2.5, 2, 0.5};
  c.detrend = true;
  EmaZScore d(c);
  EXPECT_FALSE(d.observe(10).spike);
  EXPECT_FALSE(d.observe(12).spike);  // still warming up
  // Detrended from the third value: the median of {10, 12} is 12 (the upper one), no spread yet
  // and a fall, so z is 0.
  SpikeVerdict v = d.observe(11);
  EXPECT_EQ(v.z, 0);
  EXPECT_EQ(v.reference, 12);
  EXPECT_EQ(d.state().spread, 1);  // its first deviation, (11 - 12)^2, alone
  v = d.observe(14);               // median of {10, 12, 11}: 11; z = 3 / 1
  EXPECT_EQ(v.z, 3);
  EXPECT_TRUE(v.spike);
  EXPECT_EQ(v.reference, 11);
  EXPECT_EQ(d.state().spread, 1);  // a spike moves nothing
  EXPECT_EQ(d.state().recent, (std::vector<double>{10, 12, 11}));
  v = d.observe(12);  // z = 1; spread 0.5 * 1 + 0.5 * 1
  EXPECT_EQ(v.z, 1);
  EXPECT_FALSE(v.spike);
  EXPECT_EQ(d.state().spread, 1);
  EXPECT_EQ(d.state().mean, 11.5);  // the EMA is kept beside (the clip target reads it)
}

TEST(EmaZScore, DetrendedZSeesARiseOnAFallingLossThatThePlainZScoreMisses) {
  // A loss still falling at step 150 (warm-up and cosine), with 8% batch-to-batch noise: the
  // plain EMA's mean lags above it and its variance takes in the lag, so the one-rank loss shift
  // of a 2-rank job (the mean loss x1.86) stays under z 6 (1.35 here); the detrended z: 8.64.
  EmaZScore plain;
  EmaZScore detrend(detrended());
  std::uint32_t seed = 12345;
  double loss = 0.0;
  for (int t = 1; t <= 150; ++t) {
    seed = seed * 1664525u + 1013904223u;
    const double noise = (static_cast<double>(seed >> 8) / 16777216.0) * 2.0 - 1.0;
    loss = (1.8 + 2.5 * std::exp(-t / 60.0)) * (1.0 + 0.08 * noise);
    ASSERT_FALSE(plain.observe(loss).spike) << t;
    ASSERT_FALSE(detrend.observe(loss).spike) << t;
  }
  const double shifted = 1.86 * loss;
  const SpikeVerdict p = plain.observe(shifted);
  const SpikeVerdict d = detrend.observe(shifted);
  EXPECT_FALSE(p.spike) << p.z;
  EXPECT_LT(p.z, 6.0);
  EXPECT_TRUE(d.spike) << d.z;
  EXPECT_FALSE(d.recent);  // the z-score's catch, not the recent ratio's (off here)
}

TEST(Detectors, BadConfigIsRefused) {
  EmaZScoreConfig bad_recent = recent(1.0);
  EXPECT_THROW(EmaZScore{bad_recent}, std::invalid_argument);
  EmaZScoreConfig short_window = recent(5.0);
  short_window.recent_window = 1;
  EXPECT_THROW(EmaZScore{short_window}, std::invalid_argument);
  EmaZScoreConfig bad_early;
  bad_early.early_factor = 0.5;
  EXPECT_THROW(EmaZScore{bad_early}, std::invalid_argument);
  EXPECT_THROW(EmaZScore(EmaZScoreConfig{0.0, 1, 0.5}), std::invalid_argument);
  EXPECT_THROW(EmaZScore(EmaZScoreConfig{6.0, 1, 1.0}), std::invalid_argument);
  EXPECT_THROW(RatioRule(RatioRuleConfig{1.0, 3}), std::invalid_argument);
}

}  // namespace
}  // namespace policy
}  // namespace stepguard
