/*
 * Probes: opt-in markers on module outputs (guard.probe("blocks.0", x)) that record whether each
 * output was finite in forward (call order) and, through a tensor hook, whether its gradient was
 * finite in backward (arrival order). On an incident they name the first probe where values went
 * bad, forward and backward.
 *
 * Not thread-safe: the training thread records; hooks run on autograd's thread for the same
 * backward, which the training thread waits for.
 */
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "csrc/forensics/classifier.h"

namespace stepguard {
namespace forensics {

class Probes {
 public:
  /// Records `output` under `name` and hooks its gradient; returns `output`. Costs a
  /// device-to-host read.
  at::Tensor record(const std::string& name, const at::Tensor& output);
  /// Whether a probed output or its gradient was non-finite on this step (host values).
  bool any_nonfinite() const;
  /// Fills first_bad_forward and first_bad_backward.
  void fill(Evidence* ev) const;
  /// Forgets this step's records (hooks still pending find nothing to write).
  void clear();

 private:
  struct Record {
    std::string name;
    bool forward_finite = true;
    int backward_order = -1;  ///< when its gradient arrived, among the probes; -1 = not yet
    bool grad_finite = true;
  };
  // Shared with the hooks, which may outlive a step's records.
  std::shared_ptr<std::vector<Record>> records_ = std::make_shared<std::vector<Record>>();
  std::shared_ptr<int> grads_seen_ = std::make_shared<int>(0);
};

}  // namespace forensics
}  // namespace stepguard
