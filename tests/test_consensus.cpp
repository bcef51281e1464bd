#include <gtest/gtest.h>

#include "csrc/consensus/consensus.h"
#include "stepguard/types.h"

namespace stepguard {
namespace consensus {
namespace {

TEST(LocalConsensus, SumOverOneRankIsIdentityAndCountsCollectives) {
  LocalConsensus c;
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.world_size(), 1);
  EXPECT_STREQ(c.backend_name(), "local");
  auto buffer = at::arange(stats_slot::size(1), at::TensorOptions().dtype(at::kDouble));
  const auto expected = buffer.clone();
  c.all_reduce_sum(buffer, 1);
  c.all_reduce_sum(buffer, 2);
  EXPECT_TRUE(at::equal(buffer, expected));
  EXPECT_EQ(c.collectives(), 2);
}

TEST(LocalConsensus, RejectsBuffersOfTheWrongShapeOrType) {
  LocalConsensus c;
  auto f32 = at::zeros({8}, at::kFloat);
  auto two_d = at::zeros({2, 4}, at::kDouble);
  auto strided = at::zeros({16}, at::kDouble).slice(0, 0, 16, 2);
  try {
    c.all_reduce_sum(f32, 12);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("contiguous 1-D float64 tensor (step 12)"),
              std::string::npos);
  }
  EXPECT_THROW(c.all_reduce_sum(two_d, 1), c10::Error);
  EXPECT_THROW(c.all_reduce_sum(strided, 1), c10::Error);
  EXPECT_EQ(c.collectives(), 0);
}

TEST(StatsLayout, TwoSlotsPerRankAfterTheFixedSlots) {
  EXPECT_EQ(stats_slot::size(1), 7 + 2);
  EXPECT_EQ(stats_slot::size(1024), 7 + 2048);
  EXPECT_EQ(stats_slot::rank_fault(3), 10);
  EXPECT_EQ(stats_slot::rank_digest(4, 3), 14);
  EXPECT_EQ(stats_slot::rank_digest(4, 3) + 1, stats_slot::size(4));
  // The largest digest is an integer fp64 holds exactly.
  const double d = static_cast<double>(stats_slot::kDigestMask);
  EXPECT_EQ(static_cast<std::uint64_t>(d), stats_slot::kDigestMask);
}

}  // namespace
}  // namespace consensus
}  // namespace stepguard
