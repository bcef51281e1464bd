/*
 * What the CPU pass and the CUDA launch of inspect_into() share: the gradients as the passes read
 * them, and the CUDA launch (inspect_on_cuda.cpp). Internal to csrc/inspect.
 */
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "csrc/core/stats.h"
#include "csrc/inspect/inspect.h"

namespace stepguard {
namespace inspect {
namespace detail {

// The gradients as the passes read them: a contiguous gradient itself, any other through a
// contiguous copy held here. No at::Tensor handle is copied per gradient (that is an atomic
// reference count up and down each, which adds up over many small gradients).
class GradViews {
 public:
  explicit GradViews(const std::vector<at::Tensor>& grads)
      : grads_(grads), copies_(grads.size()), dtypes_(grads.size(), GradDtype::kFloat32) {}
  std::size_t size() const { return grads_.size(); }
  const at::Tensor& operator[](std::size_t i) const {
    return copies_[i].defined() ? copies_[i] : grads_[i];
  }
  GradDtype dtype(std::size_t i) const { return dtypes_[i]; }
  void set(std::size_t i, GradDtype dtype) {
    dtypes_[i] = dtype;
    if (!grads_[i].is_contiguous()) copies_[i] = grads_[i].contiguous();
  }
  /// Writes unscaled copies back into their gradients.
  void copy_back() const {
    for (std::size_t i = 0; i < copies_.size(); ++i) {
      if (copies_[i].defined()) grads_[i].copy_(copies_[i]);
    }
  }

 private:
  const std::vector<at::Tensor>& grads_;
  std::vector<at::Tensor> copies_;  ///< defined for the non-contiguous gradients only
  std::vector<GradDtype> dtypes_;
};

/// One fused launch writing `head` in place, on the current stream of `head`'s CUDA device; no
/// host read, no host wait. `views` were validated (one CUDA device, known dtypes).
void inspect_on_cuda(const GradViews& views, const InspectOptions& options, const at::Tensor& head,
                     LocalStats* stats, DeferredBlame* blame);

}  // namespace detail
}  // namespace inspect
}  // namespace stepguard
