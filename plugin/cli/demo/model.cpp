#include "plugin/cli/demo/model.h"

#include <cmath>
#include <limits>

namespace stepguard {
namespace demo {

BlockImpl::BlockImpl(const ModelConfig& c) : heads_(c.heads) {
  TORCH_CHECK(c.d_model % c.heads == 0, "demo: d_model ", c.d_model, " is not divisible by heads ",
              c.heads);
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  qkv_ = register_module("qkv", torch::nn::Linear(c.d_model, 3 * c.d_model));
  proj_ = register_module("proj", torch::nn::Linear(c.d_model, c.d_model));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  fc_in_ = register_module("fc_in", torch::nn::Linear(c.d_model, 4 * c.d_model));
  fc_out_ = register_module("fc_out", torch::nn::Linear(4 * c.d_model, c.d_model));
  causal_mask_ = register_buffer(
      "causal_mask", torch::ones({c.context, c.context}, torch::kBool).tril().logical_not());
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  const auto B = x.size(0), T = x.size(1), C = x.size(2);
  const auto head_dim = C / heads_;
  auto qkv = qkv_->forward(ln1_->forward(x)).view({B, T, 3, heads_, head_dim});
  auto q = qkv.select(2, 0).transpose(1, 2);  // [B, H, T, hd]
  auto k = qkv.select(2, 1).transpose(1, 2);
  auto v = qkv.select(2, 2).transpose(1, 2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
  scores = scores.masked_fill(causal_mask_.slice(0, 0, T).slice(1, 0, T),
                              -std::numeric_limits<float>::infinity());
  auto attention = torch::softmax(scores, -1);  // max-subtracting softmax
  auto mixed = torch::matmul(attention, v).transpose(1, 2).reshape({B, T, C});
  auto h = x + proj_->forward(mixed);
  return h + fc_out_->forward(torch::gelu(fc_in_->forward(ln2_->forward(h))));
}

CharTransformerImpl::CharTransformerImpl(const ModelConfig& c) : config_(c) {
  token_embedding_ =
      register_module("token_embedding", torch::nn::Embedding(c.vocab_size, c.d_model));
  position_embedding_ =
      register_module("position_embedding", torch::nn::Embedding(c.context, c.d_model));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (std::int64_t i = 0; i < c.layers; ++i) blocks_->push_back(Block(c));
  ln_final_ =
      register_module("ln_final", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  head_ = register_module("head", torch::nn::Linear(c.d_model, c.vocab_size));
  // GPT-style small init keeps the first steps stable.
  torch::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    if (p.key().find("weight") != std::string::npos && p.value().dim() == 2) {
      p.value().normal_(0.0, 0.02);
    } else if (p.key().find("bias") != std::string::npos) {
      p.value().zero_();
    }
  }
}

torch::Tensor CharTransformerImpl::embed(const torch::Tensor& tokens, std::int64_t poison_row) {
  const auto T = tokens.size(1);
  auto positions = torch::arange(T, torch::TensorOptions().dtype(torch::kLong));
  auto x = token_embedding_->forward(tokens) + position_embedding_->forward(positions);
  if (poison_row >= 0) {
    auto nan_row = torch::full_like(x.select(0, poison_row), std::nanf(""));
    x = torch::cat({x.slice(0, 0, poison_row), nan_row.unsqueeze(0), x.slice(0, poison_row + 1)});
  }
  return x;
}

torch::Tensor CharTransformerImpl::forward_embedded(const torch::Tensor& embedded) {
  torch::Tensor x = embedded;
  std::size_t i = 0;
  for (const auto& block : *blocks_) {
    x = block->as<Block>()->forward(x);
    if (probe_) x = probe_("blocks." + std::to_string(i), x);
    ++i;
  }
  auto logits = head_->forward(ln_final_->forward(x));
  return probe_ ? probe_("head", logits) : logits;
}

torch::Tensor CharTransformerImpl::forward(const torch::Tensor& tokens, std::int64_t poison_row) {
  return forward_embedded(embed(tokens, poison_row));
}

}  // namespace demo
}  // namespace stepguard
