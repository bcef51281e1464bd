#include <gtest/gtest.h>

#include "csrc/consensus/consensus.h"

namespace stepguard {
namespace consensus {
namespace {

TEST(LocalConsensus, SumOverOneRankIsIdentityAndCountsCollectives) {
  LocalConsensus c;
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.world_size(), 1);
  EXPECT_STREQ(c.backend_name(), "local");
  auto buffer = at::arange(9, at::TensorOptions().dtype(at::kDouble));
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

TEST(GatherValues, OneRankGathersItsOwnValueWithoutACollective) {
  LocalConsensus c;
  EXPECT_EQ(gather_values(c, 42, 7, at::kCPU), std::vector<std::int64_t>({42}));
  EXPECT_EQ(c.collectives(), 0);
}

}  // namespace
}  // namespace consensus
}  // namespace stepguard
