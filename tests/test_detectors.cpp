// Spike detectors, with the averages worked out by hand (decay 0.5 keeps the numbers short).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

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

TEST(Detectors, BadConfigIsRefused) {
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
