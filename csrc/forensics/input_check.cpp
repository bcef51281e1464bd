#include "csrc/forensics/input_check.h"

#include <c10/util/Exception.h>

namespace stepguard {
namespace forensics {

InputCheck check_inputs(const std::vector<at::Tensor>& inputs, const at::Tensor& mask) {
  TORCH_CHECK(!mask.defined() || mask.dim() == 2,
              "stepguard: check_inputs: the mask must be [batch, sequence], got ", mask.sizes());
  // The mask describes the batch: an input of two or more dimensions is [batch, sequence, ...].
  for (std::size_t i = 0; mask.defined() && i < inputs.size(); ++i) {
    const auto& t = inputs[i];
    if (!t.defined() || t.dim() < 2) continue;
    TORCH_CHECK(t.size(0) == mask.size(0) && t.size(1) == mask.size(1),
                "stepguard: check_inputs: the mask is ", mask.sizes(), " but input ", i, " is ",
                t.sizes(), "; the mask must be [batch, sequence] of the inputs");
  }
  InputCheck out;
  std::vector<at::Tensor> counts;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const auto& t = inputs[i];
    if (!t.defined()) continue;
    out.inputs.push_back(t.detach());
    // Floating and complex inputs can hold NaN/Inf (a complex one in either part).
    if (!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type())) continue;
    out.counted_.push_back(i);
    // NaN and Inf apart: an Inf says overflow or a division by zero upstream, a NaN 0/0 or a
    // missing value.
    const at::Tensor nan = at::isnan(t.detach());
    counts.push_back(nan.sum());
    counts.push_back((~at::isfinite(t.detach()) & ~nan).sum());
  }
  if (mask.defined()) {
    out.has_mask_ = true;
    out.mask_rows_ = mask.size(0);
    out.zero_length_ = mask.size(1) == 0;
    counts.push_back((~mask.to(at::kBool).any(1)).sum());
  }
  if (counts.empty()) return out;
  for (auto& n : counts) n = n.to(counts.front().device(), at::kLong);
  out.counts_ = at::stack(counts);
  out.any_ = (out.counts_ > 0).any();
  return out;
}

const std::vector<std::string>& InputCheck::problems() const {
  if (problems_) return *problems_;
  std::vector<std::string> out;
  if (counts_.defined()) {
    const at::Tensor host = counts_.to(at::kCPU);  // the one read
    const std::int64_t* c = host.data_ptr<std::int64_t>();
    for (std::size_t k = 0; k < counted_.size(); ++k) {
      const std::int64_t nan = c[2 * k];
      const std::int64_t inf = c[2 * k + 1];
      if (nan + inf == 0) continue;
      std::string what;
      if (nan > 0) what = std::to_string(nan) + " NaN";
      if (inf > 0) what += (what.empty() ? "" : " and ") + std::to_string(inf) + " Inf";
      out.push_back("input " + std::to_string(counted_[k]) + " holds " + what + " value" +
                    (nan + inf > 1 ? "s" : ""));
    }
    if (has_mask_) {
      const std::int64_t empty = c[2 * counted_.size()];
      if (empty > 0) {
        out.push_back(std::to_string(empty) + " of " + std::to_string(mask_rows_) +
                      " sequences are empty or all padding (every position masked)");
      }
    }
  }
  if (zero_length_) out.push_back("the sequences have length 0");
  problems_ = std::move(out);
  return *problems_;
}

}  // namespace forensics
}  // namespace stepguard
