#include "plugin/src/optimizer_port.h"

namespace stepguard {

std::vector<at::Tensor> OptimizerPort::gradients() const {
  std::vector<at::Tensor> grads;
  grads.reserve(parameters().size());
  for (const auto& p : parameters()) grads.push_back(p.grad());
  return grads;
}

void OptimizerPort::discard() {
  at::NoGradGuard no_grad;
  for (const auto& p : parameters()) {
    auto& g = const_cast<at::Tensor&>(p).mutable_grad();
    if (g.defined()) g.zero_();
  }
}

}  // namespace stepguard
