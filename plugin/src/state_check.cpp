#include "plugin/src/state_check.h"

#include <optional>
#include <utility>

#include "plugin/src/moment_reset.h"

namespace stepguard {
namespace {

// "3.exp_avg_sq" -> "exp_avg_sq of blocks.0.attn.weight" (as it is when it is not that form).
std::string readable(const std::string& name, const OptimizerPort& port) {
  const std::optional<std::size_t> index = state_index(name);
  if (!index) return name;
  const std::string owner = port.state_owner(*index);
  return owner.empty() ? name : name.substr(name.find('.') + 1) + " of " + owner;
}

}  // namespace

bool StateCheck::second_moment(const std::string& name) {
  // The state keys of torch.optim and torch::optim whose values the update takes the square
  // root of (or divides by).
  static const char* const kKeys[] = {
      "exp_avg_sq", "max_exp_avg_sq", "square_avg", "square_average", "sum",
      "exp_inf",    "acc_delta",      "row_var",    "col_var",        "variance"};
  const std::string key = state_key(name);
  for (const char* k : kKeys) {
    if (key == k) return true;
  }
  return false;
}

bool StateCheck::run_if_due(std::int64_t step, std::int64_t every, const OptimizerPort& port,
                            const at::Tensor& block) {
  groups_.clear();
  if (every <= 0 || step % every != 0) return false;
  groups_.emplace_back(block.device());
  for (auto& [name, tensor] : port.state_tensors()) {
    if (!tensor.defined() || tensor.layout() != at::kStrided || tensor.numel() == 0) continue;
    const auto type = tensor.scalar_type();
    if (type != at::kFloat && type != at::kHalf && type != at::kBFloat16 && type != at::kDouble) {
      continue;  // counters and quantized states: not values the check can judge
    }
    if (!tensor.device().is_cpu() && !tensor.device().is_cuda()) continue;
    // torch.optim keeps each parameter's step counter as a host scalar beside a CUDA state:
    // checking it would cost a host-to-device copy per step for a value no update squares.
    if (tensor.numel() == 1 && tensor.device().is_cpu() && block.device().is_cuda()) continue;
    auto group = std::find_if(groups_.begin(), groups_.end(),
                              [&](const Group& g) { return g.device == tensor.device(); });
    if (group == groups_.end()) group = groups_.insert(groups_.end(), Group(tensor.device()));
    group->nonnegative.push_back(second_moment(name) ? 1 : 0);
    group->names.push_back(std::move(name));
    group->tensors.push_back(std::move(tensor));
  }
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    Group& g = groups_[i];
    inspect::InspectOptions options;
    options.nonnegative = g.nonnegative;
    options.table = 1 + static_cast<int>(i);  // the gradients keep table 0
    if (i == 0) {
      inspect::inspect_into(g.tensors, options, block, &g.local, &g.blame);
      continue;
    }
    // Another device (a state offloaded to the host beside CUDA gradients): its own pass
    // there, its four figures added in with a copy that does not wait (pinned host memory).
    const bool pinned = g.device.is_cpu() && block.device().is_cuda();
    const at::Tensor head =
        at::zeros({inspect_slot::kCount}, block.options().device(g.device).pinned_memory(pinned));
    inspect::inspect_into(g.tensors, options, head, &g.local, &g.blame);
    block.add_(head.to(block.device(), /*non_blocking=*/pinned));
  }
  return true;
}

std::vector<std::string> StateCheck::bad_tensors(std::size_t max, const OptimizerPort& port) {
  std::vector<std::string> out;
  for (Group& g : groups_) {
    if (g.blame.pending()) {
      g.blame.fetch(&g.local);
      g.blame = inspect::DeferredBlame();
    }
    for (std::int64_t i : g.local.nonfinite_tensors) {
      if (out.size() >= max) return out;
      out.push_back(readable(g.names[static_cast<std::size_t>(i)], port));
    }
  }
  return out;
}

}  // namespace stepguard
