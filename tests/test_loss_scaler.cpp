// The loss scale follows PyTorch GradScaler's documented update rule (and Megatron's hysteresis
// and floor). Expected scales are worked out by hand in the comments.
#include <gtest/gtest.h>

#include <limits>
#include <stdexcept>
#include <vector>

#include "csrc/scaling/loss_scaler.h"

namespace stepguard {
namespace scaling {
namespace {

struct Case {
  const char* name;
  LossScalerConfig config;
  std::vector<bool> nonfinite;  // one update per entry
  std::vector<double> scales;   // the scale after each update
};

TEST(LossScaler, DefaultsAreGradScalers) {
  LossScaler s;
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.config().growth_factor, 2.0);
  EXPECT_EQ(s.config().backoff_factor, 0.5);
  EXPECT_EQ(s.config().growth_interval, 2000);
  for (int i = 0; i < 1999; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.state().growth_tracker, 1999);
  s.update(false);  // the 2000th clean step grows the scale
  EXPECT_EQ(s.scale(), 131072.0);
  EXPECT_EQ(s.state().growth_tracker, 0);
  s.update(true);
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_DOUBLE_EQ(s.inv_scale(), 1.0 / 65536.0);
}

TEST(LossScaler, TableOfUpdateSequences) {
  LossScalerConfig small;
  small.init_scale = 8;
  small.growth_interval = 3;
  LossScalerConfig hysteresis = small;
  hysteresis.hysteresis = 2;
  LossScalerConfig floor;
  floor.init_scale = 4;
  floor.min_scale = 2;
  LossScalerConfig capped = small;
  capped.growth_interval = 1;
  capped.max_scale = 16;
  const std::vector<Case> cases = {
      // clean, clean: tracker 1, 2; inf halves and resets; three cleans grow; two infs halve twice.
      {"gradscaler",
       small,
       {false, false, true, false, false, false, true, true},
       {8, 8, 4, 4, 4, 8, 4, 2}},
      // Hysteresis 2: the first inf is tolerated, the second halves; growth re-arms hysteresis.
      {"hysteresis",
       hysteresis,
       {true, true, false, false, false, true, false, true},
       {8, 4, 4, 4, 8, 8, 8, 4}},
      // The floor holds the scale at 2 however many infs come.
      {"floor", floor, {true, true, true, false}, {2, 2, 2, 2}},
      // The cap holds growth at 16.
      {"max", capped, {false, false, false}, {16, 16, 16}},
  };
  for (const auto& c : cases) {
    LossScaler s(c.config);
    for (std::size_t i = 0; i < c.nonfinite.size(); ++i) {
      s.update(c.nonfinite[i]);
      EXPECT_EQ(s.scale(), c.scales[i]) << c.name << " update " << i;
    }
  }
}

TEST(LossScaler, CountsStepsAtTheFloorInsteadOfCrashing) {
  LossScalerConfig c;
  c.init_scale = 4;
  c.min_scale = 2;
  LossScaler s(c);
  s.update(true);
  EXPECT_TRUE(s.at_floor());
  EXPECT_EQ(s.state().steps_at_floor, 1);
  s.update(true);
  s.update(false);
  EXPECT_EQ(s.state().steps_at_floor, 3);
  // Without a floor there is no "at the floor".
  LossScaler none;
  for (int i = 0; i < 200; ++i) none.update(true);
  EXPECT_FALSE(none.at_floor());
  EXPECT_GT(none.scale(), 0.0);
}

TEST(LossScaler, GrowthThatWouldOverflowIsSkipped) {
  LossScalerConfig c;
  c.init_scale = 1e308;
  c.growth_interval = 1;
  LossScaler s(c);
  s.update(false);
  EXPECT_EQ(s.scale(), 1e308);
}

TEST(LossScaler, DropIsThePolicysLever) {
  LossScaler s;
  s.update(false);
  s.drop(0.25);
  EXPECT_EQ(s.scale(), 16384.0);
  EXPECT_EQ(s.state().growth_tracker, 0);
  EXPECT_THROW(s.drop(1.5), std::invalid_argument);
}

TEST(LossScaler, StateRoundTrips) {
  LossScaler a;
  a.update(true);
  a.update(false);
  LossScaler b;
  b.restore(a.state());
  EXPECT_EQ(a.state(), b.state());
  a.update(false);
  b.update(false);
  EXPECT_EQ(a.state(), b.state());
}

TEST(LossScaler, BadConfigNamesTheField) {
  auto message = [](LossScalerConfig c) {
    try {
      LossScaler s(c);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  LossScalerConfig c;
  c.backoff_factor = 1.0;
  EXPECT_EQ(message(c), "stepguard: loss_scale: backoff_factor must be in (0, 1)");
  c = {};
  c.growth_interval = 0;
  EXPECT_EQ(message(c), "stepguard: loss_scale: growth_interval must be >= 1");
  c = {};
  c.min_scale = 1e6;
  EXPECT_EQ(message(c),
            "stepguard: loss_scale: init_scale must lie between min_scale and max_scale");
  c = {};
  c.init_scale = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(message(c), "stepguard: loss_scale: init_scale must be finite and > 0");
}

}  // namespace
}  // namespace scaling
}  // namespace stepguard
