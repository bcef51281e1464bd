// Inspection under a parallel layout: summed over the ranks, the weighted blocks count every
// gradient element of the job once (expected values computed from the unsplit gradients).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "csrc/consensus/step_buffer.h"
#include "csrc/inspect/counted_once.h"

namespace stepguard {
namespace inspect {
namespace {

double squares(const at::Tensor& t) { return t.to(at::kDouble).pow(2).sum().item<double>(); }

at::Tensor block_of(const std::vector<at::Tensor>& grads, const std::vector<int>& copies,
                    LocalStats* stats = nullptr) {
  at::Tensor head = at::zeros({inspect_slot::kCount}, at::kDouble);
  LocalStats local;
  DeferredBlame blame;
  inspect_counted_once(grads, copies, InspectOptions{}, head, stats ? stats : &local, &blame);
  return head;
}

// Tensor parallel on 2 ranks: a weight split in halves, a layernorm both ranks hold. The sum of
// the two ranks' blocks is the unsplit model's sum of squares.
TEST(CountedOnce, TensorParallelCopiesCountOnceAndShardsAdd) {
  at::manual_seed(3);
  const at::Tensor weight = at::randn({8, 6});
  const at::Tensor norm = at::randn({6});
  const std::vector<at::Tensor> halves = weight.chunk(2, 0);
  at::Tensor sum = at::zeros({inspect_slot::kCount}, at::kDouble);
  for (int r = 0; r < 2; ++r) {
    sum += block_of({halves[static_cast<std::size_t>(r)].clone(), norm.clone()}, {1, 2});
  }
  EXPECT_NEAR(sum[inspect_slot::kSumSquares].item<double>(), squares(weight) + squares(norm),
              1e-12 * (squares(weight) + squares(norm)));
  EXPECT_EQ(sum[inspect_slot::kNanCount].item<double>(), 0.0);
}

// A NaN in one copy of a duplicated gradient weighs a half; the step buffer rounds it up to one.
TEST(CountedOnce, ANaNInOneCopyCountsAsOne) {
  at::Tensor sum = at::zeros({consensus::step_slot::kSize}, at::kDouble);
  for (int r = 0; r < 2; ++r) {
    consensus::StepBuffer b(r, 2, at::kCPU);
    at::Tensor norm = at::ones({4});
    if (r == 1) norm[2] = std::numeric_limits<float>::quiet_NaN();
    LocalStats local;
    DeferredBlame blame;
    inspect_counted_once({at::ones({3}), norm}, {1, 2}, InspectOptions{}, b.inspection_block(),
                         &local, &blame);
    b.pack(at::tensor(1.0), 1, consensus::LocalEvidence{});
    sum += b.tensor();
  }
  consensus::StepBuffer agreed(0, 2, at::kCPU);
  agreed.tensor().copy_(sum);
  const GlobalStats g = agreed.unpack(1);
  EXPECT_EQ(g.nan_count, 1);
  EXPECT_EQ(g.faulty_rank_count, 1);
  // The finite elements: both shards, and each copy of the norm at half weight.
  EXPECT_DOUBLE_EQ(g.sum_squares, 2 * 3.0 + 0.5 * 4.0 + 0.5 * 3.0);
}

// Per-tensor results stay in the order of the list, across the classes of copies.
TEST(CountedOnce, PerTensorResultsKeepTheListOrder) {
  LocalStats stats;
  at::Tensor bad = at::ones({2});
  bad[0] = std::numeric_limits<float>::infinity();
  block_of({at::full({2}, 2.0), bad, at::full({3}, 1.0), at::Tensor()}, {4, 1, 4, 0}, &stats);
  ASSERT_EQ(stats.tensor_sum_squares.size(), 4u);
  EXPECT_EQ(stats.tensor_sum_squares[0], 8.0);
  EXPECT_EQ(stats.tensor_sum_squares[1], 1.0);
  EXPECT_EQ(stats.tensor_sum_squares[2], 3.0);
  EXPECT_EQ(stats.tensor_sum_squares[3], 0.0);
  EXPECT_EQ(stats.nonfinite_tensors, std::vector<std::int64_t>({1}));
  EXPECT_EQ(stats.inf_count, 1);
  EXPECT_EQ(stats.num_tensors, 4);
}

// One class: one pass, the block divided by its copies (data parallel over 4 ranks).
TEST(CountedOnce, OneClassIsOnePassOverItsCopies) {
  const at::Tensor head = block_of({at::full({4}, 2.0)}, {4});
  EXPECT_EQ(head[inspect_slot::kSumSquares].item<double>(), 4.0);
}

// A gradient where the layout says the parameter is not on this rank is refused before any
// gradient changes (here: an in-place unscale).
TEST(CountedOnce, AGradientOfAnAbsentParameterIsRefusedAndNothingChanges) {
  at::Tensor g = at::full({3}, 4.0);
  at::Tensor head = at::zeros({inspect_slot::kCount}, at::kDouble);
  LocalStats stats;
  DeferredBlame blame;
  InspectOptions o;
  o.inv_scale = 0.5;
  o.unscale_in_place = true;
  try {
    inspect_counted_once({g, at::ones({2})}, {2, 0}, o, head, &stats, &blame);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("gradient 1 holds 2 elements but its placement says it is not on "
                           "this rank"),
              std::string::npos)
        << e.msg();
  }
  EXPECT_TRUE(at::equal(g, at::full({3}, 4.0)));
}

}  // namespace
}  // namespace inspect
}  // namespace stepguard
