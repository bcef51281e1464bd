#include "csrc/consensus/consensus.h"

#include <c10/util/Exception.h>

namespace stepguard {
namespace consensus {

void Consensus::all_reduce_sum(at::Tensor& buffer, std::int64_t step) {
  count(buffer, step);
  do_all_reduce_sum(buffer, step);
}

void Consensus::all_reduce_sum_on_stream(at::Tensor& buffer, std::int64_t step) {
  count(buffer, step);
  do_all_reduce_sum_on_stream(buffer, step);
}

void Consensus::count(const at::Tensor& buffer, std::int64_t step) {
  TORCH_CHECK(buffer.defined() && buffer.dim() == 1 && buffer.scalar_type() == at::kDouble &&
                  buffer.is_contiguous(),
              "stepguard: consensus buffer must be a contiguous 1-D float64 tensor (step ", step,
              ")");
  ++collectives_;
  bytes_ += buffer.numel() * static_cast<std::int64_t>(sizeof(double));
}

std::vector<std::int64_t> gather_values(Consensus& consensus, std::int64_t value, std::int64_t tag,
                                        const at::Device& device) {
  const int world = consensus.world_size();
  if (world == 1) return {value};
  at::Tensor buffer = at::zeros({world}, at::TensorOptions().dtype(at::kDouble).device(device));
  buffer.select(0, consensus.rank()).fill_(static_cast<double>(value));
  consensus.all_reduce_sum(buffer, tag);
  const at::Tensor host = buffer.to(at::kCPU);
  const double* v = host.data_ptr<double>();
  return std::vector<std::int64_t>(v, v + world);
}

void LocalConsensus::do_all_reduce_sum(at::Tensor& buffer, std::int64_t step) {
  (void)buffer;
  (void)step;
}

}  // namespace consensus
}  // namespace stepguard
