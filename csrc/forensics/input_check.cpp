#include "csrc/forensics/input_check.h"

#include <c10/util/Exception.h>

namespace stepguard {
namespace forensics {

InputCheck check_inputs(const std::vector<at::Tensor>& inputs, const at::Tensor& mask) {
  TORCH_CHECK(!mask.defined() || mask.dim() == 2,
              "stepguard: check_inputs: the mask must be [batch, sequence], got ", mask.sizes());
  InputCheck out;
  // Counts are reduced where the tensors live and read back once for the whole batch; the
  // inputs are kept by reference and copied to the host only if a report saves them.
  std::vector<std::size_t> counted;
  std::vector<at::Tensor> counts;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const auto& t = inputs[i];
    if (!t.defined()) continue;
    out.inputs.push_back(t.detach());
    if (!at::isFloatingType(t.scalar_type())) continue;
    counted.push_back(i);
    counts.push_back((~at::isfinite(t.detach())).sum());
  }
  if (mask.defined()) counts.push_back((~mask.to(at::kBool).any(1)).sum());
  if (counts.empty()) return out;
  for (auto& n : counts) n = n.to(counts.front().device(), at::kLong);
  const at::Tensor host = at::stack(counts).to(at::kCPU);  // the one read
  const std::int64_t* c = host.data_ptr<std::int64_t>();
  for (std::size_t k = 0; k < counted.size(); ++k) {
    if (c[k] > 0) {
      out.problems.push_back("input " + std::to_string(counted[k]) + " holds " +
                             std::to_string(c[k]) + " NaN/Inf value" + (c[k] > 1 ? "s" : ""));
    }
  }
  if (mask.defined()) {
    const std::int64_t empty = c[counted.size()];
    if (empty > 0) {
      out.problems.push_back(std::to_string(empty) + " of " + std::to_string(mask.size(0)) +
                             " sequences are empty or all padding (every position masked)");
    }
    if (mask.size(1) == 0) out.problems.push_back("the sequences have length 0");
  }
  return out;
}

}  // namespace forensics
}  // namespace stepguard
