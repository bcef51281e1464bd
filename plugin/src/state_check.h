/*
 * The optimizer state check (detectors.optimizer_state): on the steps it is due, before the
 * update, the wrapped optimizer's state tensors go through the fused inspection into the step
 * buffer's state block: NaN/Inf anywhere, and a finite element below zero in a second moment
 * (the update takes its square root), counted with the NaNs. The count crosses ranks with the
 * step's one collective; the tensors are named from this rank's results on incident steps only.
 *
 * Internal to the engine. Not thread-safe: the training thread drives it.
 */
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/stats.h"
#include "csrc/inspect/inspect.h"
#include "plugin/src/optimizer_port.h"

namespace stepguard {

class StateCheck {
 public:
  /// On a step the check is due (`every`: policy::state_check_every(), 0 never), inspects
  /// `port`'s floating-point state tensors into `block` (the step buffer's state block, on its
  /// device): no host read on the block's device; tensors on another device (a state offloaded
  /// to the host) are inspected there and added in without a wait; host scalars beside a CUDA
  /// block (torch.optim's step counters) are left out. Returns whether it ran (also ran()).
  bool run_if_due(std::int64_t step, std::int64_t every, const OptimizerPort& port,
                  const at::Tensor& block);
  bool ran() const noexcept { return !groups_.empty(); }
  /// This rank's state tensors that held bad elements at the last run, at most `max`, each as
  /// "exp_avg_sq of <what it belongs to>" (the port names a state tensor "<index>.<key>" and
  /// tells what the index is: OptimizerPort::state_owner()). Reads the per-tensor results left
  /// on a device: call on incident steps only.
  std::vector<std::string> bad_tensors(std::size_t max, const OptimizerPort& port);
  /// Whether a state tensor of this name must hold no negative value (a second moment).
  static bool second_moment(const std::string& name);

 private:
  struct Group {
    explicit Group(at::Device on) : device(on) {}
    at::Device device;
    std::vector<std::string> names;
    std::vector<at::Tensor> tensors;
    std::vector<std::uint8_t> nonnegative;
    LocalStats local;
    inspect::DeferredBlame blame;
  };
  std::vector<Group> groups_;  ///< per device, the block's first; empty when the check did not run
};

}  // namespace stepguard
