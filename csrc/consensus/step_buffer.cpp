#include "csrc/consensus/step_buffer.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <map>

namespace stepguard {
namespace consensus {

namespace {

// The ranks whose digest differs from the majority; ties go to the lower rank's digest. Every
// rank sees the same buffer, so every rank names the same outliers.
std::vector<int> digest_outliers(const double* s, int world_size) {
  std::map<double, int> votes;
  for (int r = 0; r < world_size; ++r) ++votes[s[step_slot::rank_digest(world_size, r)]];
  double majority = s[step_slot::rank_digest(world_size, 0)];
  for (int r = 0; r < world_size; ++r) {
    const double d = s[step_slot::rank_digest(world_size, r)];
    if (votes[d] > votes[majority]) majority = d;
  }
  std::vector<int> out;
  for (int r = 0; r < world_size; ++r) {
    if (s[step_slot::rank_digest(world_size, r)] != majority) out.push_back(r);
  }
  return out;
}

}  // namespace

StepBuffer::StepBuffer(int rank, int world_size, const at::Device& device)
    : rank_(rank),
      world_size_(world_size),
      buffer_(at::zeros({step_slot::size(world_size)},
                        at::TensorOptions().dtype(at::kDouble).device(device))) {
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "stepguard: rank ", rank,
              " is not in a world of ", world_size);
}

at::Tensor StepBuffer::inspection_block() const {
  return buffer_.narrow(0, step_slot::kInspection, inspect_slot::kCount);
}

void StepBuffer::pack(const at::Tensor& loss, std::uint64_t digest) {
  const at::Tensor l = loss.detach().reshape({}).to(buffer_.options());
  const at::Tensor finite = at::isfinite(l);
  buffer_.select(0, step_slot::kLossSum).copy_(at::where(finite, l, at::zeros_like(l)));
  buffer_.select(0, step_slot::kLossNonfinite).copy_(finite.logical_not());
  buffer_.select(0, step_slot::kRanksReporting).fill_(1.0);
  const int block = step_slot::kInspection;
  const at::Tensor bad = buffer_.select(0, block + inspect_slot::kNanCount) +
                         buffer_.select(0, block + inspect_slot::kInfCount) +
                         buffer_.select(0, step_slot::kLossNonfinite);
  buffer_.select(0, step_slot::rank_fault(rank_)).copy_(bad > 0);
  buffer_.select(0, step_slot::rank_digest(world_size_, rank_))
      .fill_(static_cast<double>(mask_digest(digest)));
}

GlobalStats StepBuffer::unpack(std::int64_t step, bool sharded_gradients) const {
  const at::Tensor host = buffer_.to(at::kCPU);
  const double* s = host.data_ptr<double>();
  const int world = world_size_;
  TORCH_CHECK(static_cast<int>(s[step_slot::kRanksReporting]) == world, "stepguard: step ", step,
              ": ", s[step_slot::kRanksReporting], " of ", world,
              " ranks reported statistics; the consensus buffer is inconsistent");
  const double* inspected = s + step_slot::kInspection;
  GlobalStats g;
  g.world_size = world;
  g.nan_count = static_cast<std::int64_t>(inspected[inspect_slot::kNanCount]);
  g.inf_count = static_cast<std::int64_t>(inspected[inspect_slot::kInfCount]);
  g.sum_squares_overflow = inspected[inspect_slot::kSumSquaresOverflow] > 0.0;
  // Replicated gradients (data parallel) count once: the mean over ranks of identical sums.
  const double sum = inspected[inspect_slot::kSumSquares];
  const double sum_squares = sharded_gradients ? sum : sum / world;
  g.sum_squares = g.sum_squares_overflow ? std::numeric_limits<double>::infinity() : sum_squares;
  g.grad_norm = std::sqrt(g.sum_squares);
  g.loss_nonfinite_ranks = static_cast<std::int64_t>(s[step_slot::kLossNonfinite]);
  const std::int64_t finite_ranks = world - g.loss_nonfinite_ranks;
  g.loss = finite_ranks > 0 ? s[step_slot::kLossSum] / static_cast<double>(finite_ranks)
                            : std::numeric_limits<double>::quiet_NaN();
  for (int r = 0; r < world; ++r) {
    if (s[step_slot::rank_fault(r)] > 0.0) g.faulty_ranks.push_back(r);
  }
  g.desynced_ranks = digest_outliers(s, world);
  return g;
}

}  // namespace consensus
}  // namespace stepguard
