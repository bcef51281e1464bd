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

#include "csrc/inspect/element_ops.h"
#include "stepguard/types.h"

namespace stepguard {
namespace inspect {

/// Options of one inspection pass.
struct InspectOptions {
  /// Multiplier applied to every element before squaring (1 / loss_scale under fp16 scaling).
  double inv_scale = 1.0;
  /// Also write g *= inv_scale back into the gradients (finite elements only).
  bool unscale_in_place = false;
};

/// Inspects `grads` (undefined tensors are allowed and count as empty). All defined gradients must
/// be on one device and be float32, float16, bfloat16 or float64; otherwise throws c10::Error with
/// a message naming the offending tensor index. Non-contiguous gradients are inspected through a
/// contiguous copy (in-place unscale then writes back through copy_).
///
/// Deterministic: the sums are reduced per fixed-size chunk and combined in tensor and chunk order,
/// so the result is bitwise identical run to run.
LocalStats inspect_gradients(const std::vector<at::Tensor>& grads,
                             const InspectOptions& options = {});

/// One chunk of at most kChunkElements elements, starting at a multiple of lanes_per_row(dtype)
/// within its tensor, in the shared reduction order (the CUDA kernel gives the same bits).
ChunkStats inspect_chunk_cpu(GradDtype dtype, const void* first_element, std::int64_t n,
                             double inv_scale);

/// Maps an ATen dtype to the inspection's element type; throws for anything else.
GradDtype grad_dtype_of(const at::Tensor& grad, std::size_t index);

}  // namespace inspect
}  // namespace stepguard
