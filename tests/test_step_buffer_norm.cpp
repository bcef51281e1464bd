// The deferred verdict's agreed gradient norm on the device (StepBuffer::norm_on_device()):
// what a framework's clip and log take instead of a host float. Expected values by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>

#include "csrc/consensus/step_buffer.h"
#include "tests/support/op_count.h"

namespace stepguard {
namespace consensus {
namespace {

// A packed buffer of one rank whose inspection block is `block` (inspect_slot order).
StepBuffer packed(double nan, double inf, double sum_squares, double overflow) {
  StepBuffer b(0, 1, at::kCPU);
  const at::Tensor head = b.inspection_block();
  head[inspect_slot::kNanCount].fill_(nan);
  head[inspect_slot::kInfCount].fill_(inf);
  head[inspect_slot::kSumSquares].fill_(sum_squares);
  head[inspect_slot::kSumSquaresOverflow].fill_(overflow);
  b.pack(at::tensor(2.0), 7, LocalEvidence{});
  return b;
}

TEST(StepBufferNorm, TheRootOfTheSummedSquaresInFp32WithNoRead) {
  StepBuffer b = packed(0, 0, 6.25, 0);
  at::Tensor norm;
  const std::map<std::string, int> ops = ops_of([&] { norm = b.norm_on_device(); });
  EXPECT_EQ(ops.count("aten::item"), 0u);
  EXPECT_EQ(ops.count("aten::_local_scalar_dense"), 0u);
  EXPECT_EQ(norm.scalar_type(), at::kFloat);
  EXPECT_EQ(norm.dim(), 0);
  EXPECT_EQ(norm.item<float>(), 2.5f);
  EXPECT_EQ(norm.item<float>(), static_cast<float>(b.unpack(1).grad_norm));
  // Rounded once, from the fp64 root: sqrt(2) in fp32 is the nearest float to the fp64 root.
  EXPECT_EQ(packed(0, 0, 2.0, 0).norm_on_device().item<float>(),
            static_cast<float>(std::sqrt(2.0)));
}

TEST(StepBufferNorm, NanForANonFiniteGradientAndInfForAnOverflow) {
  // One copy of a replicated NaN (a weighted count of 1 / copies) is enough.
  EXPECT_TRUE(std::isnan(packed(0.5, 0, 4.0, 0).norm_on_device().item<float>()));
  EXPECT_TRUE(std::isnan(packed(0, 3, 4.0, 0).norm_on_device().item<float>()));
  const float overflow = packed(0, 0, 0.0, 1).norm_on_device().item<float>();
  EXPECT_TRUE(std::isinf(overflow) && overflow > 0);
  // A NaN loss alone leaves the gradients' norm as it is (the skip flag carries the loss).
  StepBuffer nan_loss(0, 1, at::kCPU);
  nan_loss.inspection_block()[inspect_slot::kSumSquares].fill_(9.0);
  nan_loss.pack(at::tensor(std::numeric_limits<double>::quiet_NaN()), 7, LocalEvidence{});
  EXPECT_EQ(nan_loss.norm_on_device().item<float>(), 3.0f);
}

}  // namespace
}  // namespace consensus
}  // namespace stepguard
