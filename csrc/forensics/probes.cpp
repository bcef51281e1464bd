#include "csrc/forensics/probes.h"

namespace stepguard {
namespace forensics {

at::Tensor Probes::record(const std::string& name, const at::Tensor& output) {
  if (!output.defined()) return output;
  Record r;
  r.name = name;
  if (at::isFloatingType(output.scalar_type())) {
    r.forward_finite = at::isfinite(output.detach()).all().item<bool>();
  }
  const std::size_t index = records_->size();
  records_->push_back(r);
  if (output.requires_grad()) {
    auto records = records_;
    auto seen = grads_seen_;
    const_cast<at::Tensor&>(output).register_hook([records, seen, index](at::Tensor grad) {
      if (index < records->size() && (*records)[index].backward_order < 0 && grad.defined()) {
        (*records)[index].backward_order = (*seen)++;
        (*records)[index].grad_finite = at::isfinite(grad).all().item<bool>();
      }
      return grad;
    });
  }
  return output;
}

bool Probes::any_nonfinite() const {
  for (const auto& p : *records_) {
    if (!p.forward_finite || !p.grad_finite) return true;
  }
  return false;
}

void Probes::fill(Evidence* ev) const {
  for (const auto& p : *records_) {
    if (ev->first_bad_forward.empty() && !p.forward_finite) ev->first_bad_forward = p.name;
  }
  int first_backward = -1;
  for (const auto& p : *records_) {
    if (!p.grad_finite && p.backward_order >= 0 &&
        (first_backward < 0 || p.backward_order < first_backward)) {
      first_backward = p.backward_order;
      ev->first_bad_backward = p.name;
    }
  }
}

void Probes::clear() {
  records_->clear();
  *grads_seen_ = 0;
}

}  // namespace forensics
}  // namespace stepguard
