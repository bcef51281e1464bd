/*
 * The LibTorch optimizer port: drives a torch::optim::Optimizer for the step engine. Parameters
 * come from its param groups (named by identity from the model's named_parameters()); state
 * tensors are the per-parameter fields of Adam, AdamW, SGD, Adagrad and RMSprop, named
 * "<parameter index>.<field>", with the step counters and structure in the opaque bytes; any other
 * optimizer travels whole as its own serialize archive in the opaque bytes.
 *
 * Internal to the engine. Not thread-safe.
 */
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include "plugin/src/optimizer_port.h"

namespace stepguard {

class LibTorchPort final : public OptimizerPort {
 public:
  /// `optimizer` must outlive the port. Names are matched to its parameters by identity;
  /// unmatched ones get "param_<i>".
  LibTorchPort(torch::optim::Optimizer& optimizer,
               const torch::OrderedDict<std::string, torch::Tensor>& named_parameters,
               std::vector<Placement> layout = {});

  void refresh() override;
  const std::vector<at::Tensor>& parameters() const override { return params_; }
  const std::vector<std::string>& parameter_names() const override { return names_; }
  std::vector<Placement> layout() const override { return layout_; }
  void apply(double lr_factor) override;
  double largest_lr() const override;
  std::vector<NamedTensor> state_tensors() const override;
  std::string state_bytes() const override;
  void check_state_bytes(const std::string& bytes,
                         const std::vector<NamedTensor>& saved) const override;
  void load_state_bytes(const std::string& bytes, const std::vector<NamedTensor>& saved,
                        bool settings) override;

  torch::optim::Optimizer& optimizer() noexcept { return optimizer_; }

 private:
  void collect(const torch::OrderedDict<std::string, torch::Tensor>& named);
  bool typed() const;
  /// Calls visit(parameter index, type, step, fields) for every parameter with a state.
  template <typename Visit>
  void each_state(Visit visit) const;
  struct TypedEntry {
    std::size_t param;
    std::string type;
    std::int64_t step;
    std::vector<std::string> fields;
  };
  struct TypedState {
    std::vector<TypedEntry> entries;
    std::vector<double> lrs;  ///< one per param group (the live ones for an older record)
  };
  /// The typed states `json` lists and the groups' lr, checked against this optimizer and
  /// `saved`.
  TypedState read_typed(const std::string& json, const std::vector<NamedTensor>& saved) const;
  void load_typed(const std::vector<TypedEntry>& entries, const std::vector<NamedTensor>& saved);

  torch::optim::Optimizer& optimizer_;
  torch::OrderedDict<std::string, torch::Tensor> named_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<Placement> layout_;  ///< as given: one per parameter, or empty
};

}  // namespace stepguard
