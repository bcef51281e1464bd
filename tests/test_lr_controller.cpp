// The LR factor: lowered by the policy, recovering linearly after a run of good steps.
#include <gtest/gtest.h>

#include <stdexcept>

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

}  // namespace
}  // namespace scaling
}  // namespace stepguard
