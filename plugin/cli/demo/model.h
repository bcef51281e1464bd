/*
 * The demo model: a small decoder-only transformer over characters (pre-norm blocks, causal
 * multi-head attention with max-subtracted softmax, GELU MLP, tied to nothing). Big enough to
 * learn the license texts visibly in a few hundred CPU steps, small enough for two cores.
 */
#pragma once

#include <torch/torch.h>

#include <functional>
#include <string>

namespace stepguard {
namespace demo {

struct ModelConfig {
  std::int64_t vocab_size = 96;
  std::int64_t context = 64;
  std::int64_t d_model = 128;
  std::int64_t heads = 4;
  std::int64_t layers = 2;
};

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const ModelConfig& config);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  std::int64_t heads_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc_in_{nullptr}, fc_out_{nullptr};
  torch::Tensor causal_mask_;
};
TORCH_MODULE(Block);

class CharTransformerImpl : public torch::nn::Module {
 public:
  explicit CharTransformerImpl(const ModelConfig& config);
  /// Logits [B, T, vocab] for token ids [B, T]. When `poison_row` >= 0, that row's input
  /// embeddings are replaced by NaN (the demo's nan_input fault: bad data entering the model).
  torch::Tensor forward(const torch::Tensor& tokens, std::int64_t poison_row = -1);
  /// The two halves of forward(): the input embeddings [B, T, C] (what the data feeds the
  /// network, checked by guard.check_inputs), and the logits from them.
  torch::Tensor embed(const torch::Tensor& tokens, std::int64_t poison_row = -1);
  torch::Tensor forward_embedded(const torch::Tensor& x);
  /// Wraps each block's output ("blocks.<i>") and the logits ("head") in forward_embedded, e.g.
  /// with GuardedOptimizer::probe, so forensics can name the first bad block. Empty: none.
  using Probe = std::function<torch::Tensor(const std::string&, const torch::Tensor&)>;
  void set_probe(Probe probe) { probe_ = std::move(probe); }

 private:
  Probe probe_;
  ModelConfig config_;
  torch::nn::Embedding token_embedding_{nullptr}, position_embedding_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm ln_final_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(CharTransformer);

}  // namespace demo
}  // namespace stepguard
