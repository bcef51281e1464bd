/*
 * The LibTorch optimizer per-parameter states stepguard copies field by field (Adam, AdamW, SGD,
 * Adagrad, RMSprop): read a state into named tensors, build one back. The one place that knows
 * their fields; the LibTorch optimizer port uses it. Other optimizers go through their own
 * serialize archive. Thread-compatible.
 */
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace stepguard {
namespace libtorch_port {

/// A state's tensors by field name, in a fixed order per type.
using StateFields = std::vector<std::pair<std::string, at::Tensor>>;

/// The state's type name ("adamw", "adam", "sgd", "adagrad", "rmsprop"), its step count and its
/// tensors (undefined where unused); false for a type without a field-by-field copy.
bool read_fields(const torch::optim::OptimizerParamState& s, std::string* type, std::int64_t* step,
                 StateFields* fields);
/// Whether `optimizer` keeps states of `type`.
bool optimizer_is(const torch::optim::Optimizer& optimizer, const std::string& type);
/// A new state of `type` holding `fields` as given (no copies); `type` must be a known one.
std::unique_ptr<torch::optim::OptimizerParamState> make_state(
    const std::string& type, std::int64_t step, std::map<std::string, at::Tensor>& fields);

}  // namespace libtorch_port
}  // namespace stepguard
