/*
 * Gradient inspection: one pass over all gradients of a model that yields the NaN and Inf
 * element counts, the fp64 sum of squares (hence the grad norm) and per-tensor sums and flags for
 * blame. This is the CPU implementation over ATen tensors; the CUDA kernel lives in cuda/.
 *
 * Not here: agreeing across ranks (consensus) or deciding anything (policy).
 */
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "csrc/core/report.h"
#include "csrc/core/stats.h"
#include "csrc/inspect/element_ops.h"

namespace stepguard {
namespace inspect {

/// Options of one inspection pass.
struct InspectOptions {
  /// Multiplier applied to every element before squaring (1 / loss_scale under fp16 scaling).
  double inv_scale = 1.0;
  /// Also write g *= inv_scale back into the gradients (finite elements only).
  bool unscale_in_place = false;
  /// One flag per tensor (empty: none set): a finite element below zero in a flagged tensor
  /// counts as NaN (an optimizer's second moment, which the update takes the square root of).
  std::vector<std::uint8_t> nonnegative;
  /// Which of a thread's cached CUDA chunk tables this list keeps between calls (a list that
  /// alternates with another on the same stream, the gradients and the optimizer state, keeps
  /// its own: no rebuild per call, capturable in a CUDA graph). Any small integer.
  int table = 0;
};

/// Per-tensor results that stayed on the gradients' device (CUDA path): read, in one small
/// device-to-host copy, only when an incident needs blame. Empty after a CPU inspection, whose
/// LocalStats already hold them.
struct DeferredBlame {
  at::Tensor tensor_sum_squares;  ///< float64, one per gradient
  at::Tensor tensor_nonfinite;    ///< int32, 1 where the gradient holds NaN/Inf
  bool pending() const noexcept { return tensor_nonfinite.defined(); }
  /// Copies the per-tensor results into `stats` (tensor_sum_squares, nonfinite_tensors).
  void fetch(LocalStats* stats) const;
};

/// Inspects `grads` (undefined tensors are allowed and count as empty) and writes NaN count, Inf
/// count, sum of squares (0 when it overflowed) and the overflow flag into `head`, a float64
/// tensor of inspect_slot::kCount elements on the gradients' device, in inspect_slot order:
/// inspection's block of the step buffer (StepBuffer::inspection_block()), so the per-step
/// collective takes them as they are.
///
/// CPU gradients: `stats` receives everything as well. CUDA gradients: one kernel launch writes
/// `head` and nothing is read back: `stats` receives the element counts only, the per-tensor
/// results wait in `blame`.
///
/// All defined gradients must be on one device and be float32, float16, bfloat16 or float64;
/// otherwise throws c10::Error naming the offending tensor, before anything changes.
/// Non-contiguous gradients are inspected through a contiguous copy (in-place unscale then writes
/// back through copy_). Deterministic: sums are reduced per fixed-size chunk and combined in tensor
/// and chunk order, so the result is bitwise identical run to run and across thread counts.
void inspect_into(const std::vector<at::Tensor>& grads, const InspectOptions& options,
                  const at::Tensor& head, LocalStats* stats, DeferredBlame* blame);

/// The checks inspect_into() makes before it touches anything (devices, dtypes, layouts, the
/// shape of `head`): throws c10::Error naming the gradient by its index in `grads`.
void check_gradients(const std::vector<at::Tensor>& grads, const at::Tensor& head);

/// inspect_into() with the results read back into one LocalStats (tests, tools).
LocalStats inspect_gradients(const std::vector<at::Tensor>& grads,
                             const InspectOptions& options = {});

/// Maps an ATen dtype to the inspection's element type; throws for anything else.
GradDtype grad_dtype_of(const at::Tensor& grad, std::size_t index);

}  // namespace inspect
}  // namespace stepguard
