// The LR factor: lowered by the policy, recovering linearly after a run of good steps.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "csrc/scaling/lr_controller.h"

namespace stepguard {
namespace scaling {
namespace {

TEST(LrController, LowersThenRecoversOnSchedule) {
  LrController lr;
  EXPECT_EQ(lr.factor(), 1.0);
  lr.lower(0.5, 0.1, /*recover_after=*/2, /*recover_over=*/4);
  EXPECT_EQ(lr.factor(), 0.5);
  lr.on_step(true);
  lr.on_step(true);
  EXPECT_EQ(lr.factor(), 0.5);  // still waiting: 2 good steps before recovery starts
  lr.on_step(true);
  EXPECT_EQ(lr.factor(), 0.625);  // 0.5 + 0.5 * 1/4
  lr.on_step(true);
  EXPECT_EQ(lr.factor(), 0.75);
  lr.on_step(false);  // a bad step pauses recovery and restarts the wait
  EXPECT_EQ(lr.factor(), 0.75);
  lr.on_step(true);
  lr.on_step(true);
  EXPECT_EQ(lr.factor(), 0.75);
  lr.on_step(true);
  EXPECT_EQ(lr.factor(), 0.875);
  lr.on_step(true);
  EXPECT_EQ(lr.factor(), 1.0);
  lr.on_step(true);
  EXPECT_EQ(lr.factor(), 1.0);
}

TEST(LrController, FloorAndNoRecovery) {
  LrController lr;
  lr.lower(0.1, 0.25, 0, 0);
  EXPECT_EQ(lr.factor(), 0.25);  // max(0.1, 0.25)
  lr.lower(0.5, 0.25, 0, 0);
  EXPECT_EQ(lr.factor(), 0.25);
  for (int i = 0; i < 100; ++i) lr.on_step(true);
  EXPECT_EQ(lr.factor(), 0.25);  // recover_over 0: stays lowered
}

TEST(LrController, LoweringAgainRestartsTheSchedule) {
  LrController lr;
  lr.lower(0.5, 0.01, 0, 2);
  lr.on_step(true);
  EXPECT_EQ(lr.factor(), 0.75);
  lr.lower(0.5, 0.01, 0, 3);  // 0.75 * 0.5
  EXPECT_EQ(lr.factor(), 0.375);
  lr.on_step(true);
  EXPECT_DOUBLE_EQ(lr.factor(), 0.375 + 0.625 / 3);
}

TEST(LrController, BadParametersAreRefused) {
  LrController lr;
  EXPECT_THROW(lr.lower(1.0, 0.1, 0, 0), std::invalid_argument);
  EXPECT_THROW(lr.lower(0.5, 0.0, 0, 0), std::invalid_argument);
  EXPECT_THROW(lr.lower(0.5, 0.1, -1, 0), std::invalid_argument);
  EXPECT_EQ(lr.factor(), 1.0);
}

// A crafted recovered_steps of 2^63-1 loaded, overflowed on the next good step and turned the
// factor to -4.6e16 (gradient ascent). Every count is bounded where the arithmetic stays exact.
TEST(LrController, RestoreRefusesCountsThatWouldOverflow) {
  LrController lr;
  lr.lower(0.5, 0.01, 0, 10);
  const LrControllerState before = lr.state();
  const auto refusal = [&lr](LrControllerState st) {
    try {
      lr.restore(st);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("restored");
  };
  LrControllerState st = before;
  st.recovered_steps = std::numeric_limits<std::int64_t>::max();
  EXPECT_EQ(refusal(st),
            "the LR controller's recovered_steps 9223372036854775807 is not in [0, 2^52]");
  st = before;
  st.recovered_steps = 10;  // a recovery that ended has recover_over 0
  EXPECT_EQ(refusal(st), "the LR controller's recovered_steps 10 is past recover_over 10");
  for (std::int64_t LrControllerState::*field :
       {&LrControllerState::good_steps, &LrControllerState::recover_after,
        &LrControllerState::recover_over}) {
    st = before;
    st.*field = -1;
    EXPECT_NE(refusal(st), "restored");
    st.*field = (std::int64_t{1} << 52) + 1;
    EXPECT_NE(refusal(st), "restored");
  }
  st = before;
  st.factor = 0.0;
  EXPECT_EQ(refusal(st), "the LR controller's LR factor 0.000000 is not in (0, 1]");
  EXPECT_EQ(lr.state(), before);
  // The largest counts accepted: recovery still walks the factor up within (0, 1].
  st = before;
  st.good_steps = std::int64_t{1} << 52;
  st.recover_over = std::int64_t{1} << 52;
  st.recovered_steps = (std::int64_t{1} << 52) - 2;
  ASSERT_EQ(refusal(st), "restored");
  for (int i = 0; i < 4; ++i) {
    lr.on_step(true);
    EXPECT_GT(lr.factor(), 0.0);
    EXPECT_LE(lr.factor(), 1.0);
  }
  EXPECT_EQ(lr.factor(), 1.0);
}

}  // namespace
}  // namespace scaling
}  // namespace stepguard
