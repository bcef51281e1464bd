// The loss scale follows PyTorch GradScaler's documented update rule (and Megatron's hysteresis
// and floor). Expected scales are worked out by hand in the comments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
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
  // Without a floor of its own the scale stops at 2^-126 (its fp32 inverse still finite): there
  // it is at its floor.
  LossScaler none;
  for (int i = 0; i < 200; ++i) none.update(true);
  EXPECT_TRUE(none.at_floor());
  EXPECT_EQ(none.scale(), kMinUsableScale);
}

TEST(LossScaler, GrowthThatWouldOverflowIsSkipped) {
  LossScalerConfig c;
  c.init_scale = kMaxUsableScale;  // 2^126: growing it would leave the usable range
  c.growth_interval = 1;
  LossScaler s(c);
  s.update(false);
  EXPECT_EQ(s.scale(), kMaxUsableScale);
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
            "stepguard: loss_scale: init_scale must lie between min_scale and max_scale, and in "
            "[2^-126, 2^126]");
  c = {};
  c.init_scale = 1e-39;  // its inverse is no finite fp32
  EXPECT_EQ(message(c),
            "stepguard: loss_scale: init_scale must lie between min_scale and max_scale, and in "
            "[2^-126, 2^126]");
  c = {};
  c.init_scale = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(message(c), "stepguard: loss_scale: init_scale must be finite and > 0");
}

// GradScaler's rule has no floor: a long streak of overflows halved the scale to 4.6e-41, whose
// fp32 inverse is Inf, and a clean step then wrote NaN weights. The scale stops where it and its
// inverse are still finite fp32 numbers, and says it is at its floor (the policy then escalates).
TEST(LossScaler, NeverGoesWhereItsInverseIsNoFiniteFloat) {
  LossScaler s;  // min_scale 0: "no floor"
  for (int i = 0; i < 400; ++i) s.update(true);
  EXPECT_EQ(s.scale(), kMinUsableScale);
  EXPECT_TRUE(s.at_floor());
  EXPECT_TRUE(std::isfinite(static_cast<float>(s.inv_scale())));
  EXPECT_EQ(s.state().steps_at_floor, 400 - 141);  // at 2^16 * 2^-142 = 2^-126 from update 142
  s.drop(0.5);
  EXPECT_EQ(s.scale(), kMinUsableScale);
  LossScalerConfig grow;
  grow.growth_interval = 1;
  LossScaler g(grow);
  for (int i = 0; i < 400; ++i) g.update(false);
  EXPECT_EQ(g.scale(), kMaxUsableScale);
  EXPECT_TRUE(std::isfinite(static_cast<float>(g.scale())));
  EXPECT_GT(static_cast<float>(g.inv_scale()), 0.0f);
}

// A saved state is restored only when this scaler could have reached it: a scale of 1e-300
// loaded and its first step wrote NaN weights; 5e-324 made every step raise.
TEST(LossScaler, RestoreRefusesStatesItCannotReach) {
  LossScalerConfig c;
  c.growth_interval = 100;
  c.hysteresis = 2;
  LossScaler s(c);
  const LossScalerState before = s.state();
  const auto refusal = [&s](LossScalerState st) {
    try {
      s.restore(st);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("restored");
  };
  LossScalerState st = before;
  for (double scale : {1e-300, 5e-324, 1e300, 0.0, -1.0, std::numeric_limits<double>::infinity(),
                       std::numeric_limits<double>::quiet_NaN()}) {
    st.scale = scale;
    EXPECT_EQ(refusal(st).rfind("stepguard: loss_scale: the saved scale ", 0), 0u) << scale;
  }
  st = before;
  st.growth_tracker = 100;
  EXPECT_EQ(refusal(st), "stepguard: loss_scale: the saved growth tracker 100 is not in [0, 100)");
  st = before;
  st.hysteresis_left = 3;
  EXPECT_EQ(refusal(st), "stepguard: loss_scale: the saved hysteresis 3 is not in [0, 2]");
  st = before;
  st.steps_at_floor = std::numeric_limits<std::int64_t>::max();
  EXPECT_EQ(refusal(st).rfind("stepguard: loss_scale: the saved count of steps at the floor", 0),
            0u);
  EXPECT_EQ(s.state(), before);
  st = before;
  st.scale = 1024.0;
  st.growth_tracker = 99;
  EXPECT_EQ(refusal(st), "restored");
  EXPECT_EQ(s.scale(), 1024.0);
}

}  // namespace
}  // namespace scaling
}  // namespace stepguard
