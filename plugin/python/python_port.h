/*
 * The torch.optim port: drives a Python optimizer for the step engine through a Python port object
 * (stepguard._port.TorchOptimPort, or an adapter deriving from it). Every call takes the GIL for
 * the Python work it does; the engine itself runs with the GIL released.
 *
 * The port object provides: parameters() -> (list of tensors, list of names); apply(lr_factor);
 * state_tensors() -> list of (name, tensor); state_bytes() -> bytes;
 * check_state_bytes(bytes, saved) and load_state_bytes(bytes, saved, settings) with saved a list of
 * (name, tensor); after_restore(); and optionally gradients() -> list of tensors or None,
 * sharded_state() -> bool, gradients_reduced_into_shards() -> bool, layout() -> list of
 * stepguard.Placement (one per parameter, read when the parameter list is first seen and whenever
 * its length changes) or None, and framework_loss_scale() -> (scale, floor) or (scale, floor,
 * gradients_scaled) or None (read every step; gradients_scaled defaults to True; a port that has it
 * owns the loss scale: OptimizerPort::owns_loss_scale).
 *
 * Internal to the Python extension. Not thread-safe: the training thread drives it.
 */
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "plugin/src/optimizer_port.h"

namespace stepguard {

class PythonPort final : public OptimizerPort {
 public:
  /// `port` is the Python port object; it is kept alive by this port.
  explicit PythonPort(pybind11::object port);
  ~PythonPort() override;

  void refresh() override;
  const std::vector<at::Tensor>& parameters() const override { return params_; }
  const std::vector<std::string>& parameter_names() const override { return names_; }
  std::vector<at::Tensor> gradients() const override;
  void apply(double lr_factor) override;
  std::vector<NamedTensor> state_tensors() const override;
  std::string state_bytes() const override;
  void check_state_bytes(const std::string& bytes,
                         const std::vector<NamedTensor>& saved) const override;
  void load_state_bytes(const std::string& bytes, const std::vector<NamedTensor>& saved,
                        bool settings) override;
  void after_restore() override;
  bool sharded_state() const override;
  bool gradients_reduced_into_shards() const override;
  std::optional<FrameworkLossScale> framework_loss_scale() const override;
  double largest_lr() const override;
  std::string state_owner(std::size_t index) const override;
  /// A port with framework_loss_scale() is a framework's: it decides the loss scale.
  bool owns_loss_scale() const override { return has_framework_scale_; }
  std::vector<Placement> layout() const override { return layout_; }

  const pybind11::object& object() const noexcept { return port_; }

 private:
  pybind11::object port_;
  bool has_gradients_ = false;
  bool has_sharded_state_ = false;
  bool has_reduced_into_shards_ = false;
  bool has_layout_ = false;
  bool has_framework_scale_ = false;
  bool has_largest_lr_ = false;
  bool has_state_owner_ = false;
  bool layout_read_ = false;
  std::vector<Placement> layout_;  ///< the port's layout() when the parameter list last changed
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
};

}  // namespace stepguard
