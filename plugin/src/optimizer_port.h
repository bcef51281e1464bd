/*
 * OptimizerPort: the narrow interface through which the step engine drives a user's optimizer.
 * The engine needs the gradients (with their parameters' names), to apply the step with an LR
 * factor or discard it, the named state tensors a snapshot copies and a restore writes back in
 * place, optional opaque state bytes for what is not a tensor, and a hook after a restore.
 *
 * Ports: LibTorch's torch::optim::Optimizer (libtorch_port.h); the Python package's
 * torch.optim.Optimizer. Internal to the engine (not installed). Not thread-safe: the training
 * thread drives it.
 */
#pragma once

#include <ATen/ATen.h>

#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "csrc/checkpoint/named_tensors.h"
#include "stepguard/layout.h"

namespace stepguard {

using checkpoint::NamedTensor;

class OptimizerPort {
 public:
  virtual ~OptimizerPort() = default;

  /// Brings the parameter list up to date (param groups may be added between steps); called at
  /// the start of every step.
  virtual void refresh() {}
  /// The guarded parameters in a fixed order, and their names (for blame in reports).
  virtual const std::vector<at::Tensor>& parameters() const = 0;
  virtual const std::vector<std::string>& parameter_names() const = 0;
  /// The gradients to inspect, one per parameter (undefined where a parameter has none).
  virtual std::vector<at::Tensor> gradients() const;
  /// How the ranks hold each parameter's gradient (stepguard/layout.h), one per parameter, read
  /// at construction and whenever refresh() changes the number of parameters. Empty: every
  /// parameter by GuardOptions::sharded_gradients (all Placement::shard() when set, all
  /// Placement::replica() otherwise).
  virtual std::vector<Placement> layout() const { return {}; }

  /// Steps the wrapped optimizer with every learning rate multiplied by `lr_factor` for this step
  /// only: the loop's own lr values and schedulers are left as they were.
  virtual void apply(double lr_factor) = 0;
  /// Drops this step's gradients (zeroes them), for a step that is not applied.
  virtual void discard();
  /// The largest learning rate of the optimizer's groups, before the guard's LR factor (the
  /// stall detector's); NaN when the port cannot tell without a read from the device.
  virtual double largest_lr() const { return std::numeric_limits<double>::quiet_NaN(); }

  /// The optimizer's state tensors under stable names, in a fixed order: snapshots and
  /// checkpoints copy them; a restore writes back into them in place.
  virtual std::vector<NamedTensor> state_tensors() const = 0;
  /// What the state tensors named "<index>.<key>" belong to, for a report ("exp_avg_sq of
  /// <this>"): by default the parameter of that index; a port whose state is keyed by other
  /// tensors (DeepSpeed's flat partitions) names those. Empty when unknown. Incident steps only.
  virtual std::string state_owner(std::size_t index) const {
    const auto& names = parameter_names();
    return index < names.size() ? names[index] : std::string();
  }
  /// What the state holds beyond those tensors (step counters, structure, or a whole archive for
  /// an optimizer without named tensors); empty when nothing.
  virtual std::string state_bytes() const { return {}; }
  /// Throws c10::Error when `bytes` and `saved` could not be loaded into this optimizer; changes
  /// nothing. Checks what it can without loading (an opaque archive is checked only by loading).
  virtual void check_state_bytes(const std::string& bytes,
                                 const std::vector<NamedTensor>& saved) const = 0;
  /// First half of a restore: puts back what state_bytes() held and makes state_tensors() name
  /// exactly the tensors in `saved` (allocating any that do not exist yet, e.g. before the first
  /// step), ready to be filled in place. Throws c10::Error, changing nothing, when the bytes do
  /// not fit this optimizer. With `settings` (a resume from a disk checkpoint) the param groups'
  /// hyper-parameters the bytes recorded (lr and the like) are put back too, as a framework's
  /// load_state_dict does; a rollback (false) leaves the live ones: the loop's LR schedule goes
  /// on across it.
  virtual void load_state_bytes(const std::string& bytes, const std::vector<NamedTensor>& saved,
                                bool settings) = 0;
  /// Called once a restore (snapshot or checkpoint) has written everything back.
  virtual void after_restore() {}
  /// True when each rank holds only its own shard of the optimizer state (ZeRO), so a checkpoint
  /// cannot move to another number of ranks; used in the message that refuses it.
  virtual bool sharded_state() const { return false; }
  /// True when the framework reduces the gradients into shards before the guard, or any hook it
  /// can place, sees them (FSDP2's DTensor gradients, set after their reduce-scatter): a rank's
  /// shard then holds what every rank sent it, so a NaN found there need not have been made there
  /// (unless the gradient watch saw them before, which a framework integration installs where it
  /// can: then the origin is named). Read once, at construction.
  virtual bool gradients_reduced_into_shards() const { return false; }
  /// The framework's loss scale when the framework's own scaler owns it (DeepSpeed's and
  /// Megatron's fp16, torch's GradScaler under Lightning and HF): `scale` is the one this step's
  /// backward used. With `gradients_scaled` the gradients arrive multiplied by it and the guard
  /// inspects them unscaled (not in place: the framework unscales them in its step); without,
  /// the framework has unscaled them already (GradScaler's unscale_, Megatron's prepare_grads).
  /// The guard reports that scale and treats an overflow as the scaler's while `scale` is above
  /// `min_scale`. Nothing when the framework scales nothing (or the guard's own loss scaling is
  /// used).
  struct FrameworkLossScale {
    double scale = 1.0;
    double min_scale = 0.0;
    bool gradients_scaled = true;
    /// Where the framework's scaler keeps them on the device (GradScaler, Megatron's): one-element
    /// tensors that ride in the step buffer, read with the step's one read (then `scale` and
    /// `min_scale` are filled from them after the collective). Not with gradients_scaled, whose
    /// inspection needs the scale before it.
    at::Tensor scale_tensor;
    at::Tensor min_scale_tensor;
  };
  virtual std::optional<FrameworkLossScale> framework_loss_scale() const { return std::nullopt; }
  /// True when a framework decides the loss scale (its own scaler in fp16, none in bf16 or fp32;
  /// every framework integration's port): the guard's own loss scaling is refused, and a
  /// policy's `loss_scale` section (a preset's: `megatron`, `deepspeed-fp16`) describes the
  /// framework's scaler instead of turning one of the guard's on. Read once, at construction.
  virtual bool owns_loss_scale() const { return false; }
};

}  // namespace stepguard
