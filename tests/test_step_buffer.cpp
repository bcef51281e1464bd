// The per-step buffer: its layout, what a rank packs, and what unpacking the sum yields
// (agreed statistics, faulty ranks, the digest majority vote). Expected values by hand.
#include <gtest/gtest.h>

#include <cmath>

#include "csrc/consensus/step_buffer.h"

namespace stepguard {
namespace consensus {
namespace {

TEST(StepBuffer, TwoSlotsPerRankAfterTheFixedSlots) {
  EXPECT_EQ(step_slot::kFixed, inspect_slot::kCount + 3);
  EXPECT_EQ(step_slot::size(1), 7 + 2);
  EXPECT_EQ(step_slot::size(1024), 7 + 2048);
  EXPECT_EQ(step_slot::rank_fault(3), 10);
  EXPECT_EQ(step_slot::rank_digest(4, 3), 14);
  EXPECT_EQ(step_slot::rank_digest(4, 3) + 1, step_slot::size(4));
  // The largest digest is an integer fp64 holds exactly.
  const double d = static_cast<double>(step_slot::kDigestMask);
  EXPECT_EQ(static_cast<std::uint64_t>(d), step_slot::kDigestMask);
  EXPECT_EQ(mask_digest(~std::uint64_t{0}), step_slot::kDigestMask);
}

TEST(StepBuffer, PacksTheLossFaultFlagAndDigestOfItsRank) {
  StepBuffer b(1, 3, at::kCPU);
  b.inspection_block().copy_(at::tensor({2.0, 0.0, 9.0, 0.0}, at::kDouble));
  b.pack(at::tensor(1.5f), 12345);
  const at::Tensor t = b.tensor();
  ASSERT_EQ(t.numel(), step_slot::size(3));
  EXPECT_EQ(t[step_slot::kLossSum].item<double>(), 1.5);
  EXPECT_EQ(t[step_slot::kLossNonfinite].item<double>(), 0.0);
  EXPECT_EQ(t[step_slot::kRanksReporting].item<double>(), 1.0);
  EXPECT_EQ(t[step_slot::rank_fault(0)].item<double>(), 0.0);
  EXPECT_EQ(t[step_slot::rank_fault(1)].item<double>(), 1.0);  // two NaN gradient elements
  EXPECT_EQ(t[step_slot::rank_digest(3, 1)].item<double>(), 12345.0);
  EXPECT_EQ(t[step_slot::rank_digest(3, 0)].item<double>(), 0.0);
}

// Three ranks' buffers summed by hand, as the all-reduce would.
TEST(StepBuffer, UnpacksTheSumAndNamesTheDivergedRank) {
  at::Tensor sum;
  const double losses[] = {1.0, 3.0, NAN};
  const std::uint64_t digests[] = {7, 7, 8};
  for (int r = 0; r < 3; ++r) {
    StepBuffer b(r, 3, at::kCPU);
    b.inspection_block().copy_(at::tensor({0.0, r == 0 ? 1.0 : 0.0, 4.0, 0.0}, at::kDouble));
    b.pack(at::tensor(losses[r], at::kDouble), digests[r]);
    sum = r == 0 ? b.tensor().clone() : sum + b.tensor();
  }
  StepBuffer agreed(0, 3, at::kCPU);
  agreed.tensor().copy_(sum);
  const GlobalStats g = agreed.unpack(5, /*sharded_gradients=*/false);
  EXPECT_EQ(g.inf_count, 1);
  EXPECT_EQ(g.loss_nonfinite_ranks, 1);
  EXPECT_EQ(g.loss, 2.0);         // mean of the finite losses
  EXPECT_EQ(g.sum_squares, 4.0);  // replicated gradients count once: 12 / 3
  EXPECT_EQ(g.grad_norm, 2.0);
  EXPECT_EQ(g.faulty_ranks, std::vector<int>({0, 2}));
  EXPECT_EQ(g.desynced_ranks, std::vector<int>({2}));
  EXPECT_EQ(agreed.unpack(5, /*sharded_gradients=*/true).sum_squares, 12.0);
}

TEST(StepBuffer, AMissingRankIsAClearError) {
  StepBuffer b(0, 2, at::kCPU);
  b.pack(at::tensor(1.0), 1);  // only this rank's contribution: 1 of 2 reported
  try {
    b.unpack(9, false);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("step 9: 1 of 2 ranks reported statistics"), std::string::npos)
        << e.msg();
  }
}

}  // namespace
}  // namespace consensus
}  // namespace stepguard
