#include "plugin/src/optimizer_port.h"

#include <ATen/core/grad_mode.h>

namespace stepguard {

std::vector<at::Tensor> OptimizerPort::gradients() const {
  std::vector<at::Tensor> grads;
  grads.reserve(parameters().size());
  for (const auto& p : parameters()) grads.push_back(p.grad());
  return grads;
}

void OptimizerPort::discard() {
  at::NoGradGuard no_grad;
  // The gradients the port inspects (a sharded parameter's are its local shard's, in place).
  for (at::Tensor& g : gradients()) {
    if (g.defined()) g.zero_();
  }
}

}  // namespace stepguard
