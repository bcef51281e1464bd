// A small model, a deterministic loss per batch and bitwise comparisons, shared by the tests that
// train through the guard.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace stepguard {
namespace {

inline torch::nn::Sequential make_model(std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 4));
}

inline torch::Tensor loss_of(torch::nn::Sequential& model, std::int64_t batch) {
  torch::manual_seed(1000 + batch);
  auto x = torch::randn({5, 8});
  auto y = torch::randn({5, 4});
  return torch::mse_loss(model->forward(x), y);
}

inline bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.dtype() == b.dtype() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(),
                     a.numel() * a.element_size()) == 0;
}

inline std::vector<torch::Tensor> clone_all(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

// The AdamW moments of every parameter, cloned.
inline std::vector<torch::Tensor> adamw_state(torch::optim::AdamW& opt) {
  std::vector<torch::Tensor> out;
  for (auto& group : opt.param_groups()) {
    for (auto& p : group.params()) {
      auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it == opt.state().end()) continue;
      auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
      out.push_back(s.exp_avg().clone());
      out.push_back(s.exp_avg_sq().clone());
      out.push_back(torch::tensor(s.step()));
    }
  }
  return out;
}

}  // namespace
}  // namespace stepguard
