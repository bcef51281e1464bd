#include "csrc/consensus/consensus.h"

#include <c10/util/Exception.h>

namespace stepguard {
namespace consensus {

void Consensus::all_reduce_sum(at::Tensor& buffer, std::int64_t step) {
  TORCH_CHECK(buffer.defined() && buffer.dim() == 1 && buffer.scalar_type() == at::kDouble &&
                  buffer.is_contiguous(),
              "stepguard: consensus buffer must be a contiguous 1-D float64 tensor (step ", step,
              ")");
  ++collectives_;
  do_all_reduce_sum(buffer, step);
}

void LocalConsensus::do_all_reduce_sum(at::Tensor& buffer, std::int64_t step) {
  (void)buffer;
  (void)step;
}

}  // namespace consensus
}  // namespace stepguard
