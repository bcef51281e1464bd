/*
 * Inspection under a parallel layout: every gradient element of the job counted once across
 * ranks. Gradient i is held identically by copies[i] ranks (data-parallel replicas, tensor-parallel
 * duplicates, a shard held by one rank); its contribution to the step buffer's inspection block
 * is weighted by 1 / copies[i], so the all-reduce's SUM counts it once: the sum of squares, and
 * the NaN and Inf counts (fractions when the copies disagree, which the step buffer rounds up).
 * copies[i] == 0: not held on this rank (another pipeline stage), never inspected.
 *
 * One inspect_into() pass per distinct copy count (one in a data-parallel job, two or three under
 * tensor parallelism): every gradient is still read once. Not here: where the copy counts come
 * from (the port's layout, resolved by the engine). Not thread-safe: one call per step.
 */
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "csrc/inspect/inspect.h"

namespace stepguard {
namespace inspect {

/// inspect_into() with gradient i weighted by 1 / copies[i] in `head` (copies.size() ==
/// grads.size()). `stats` holds this rank's own, unweighted figures and per-tensor results in
/// the order of `grads`; `blame`, on CUDA, the per-tensor results left on the device, in that
/// order too. Throws c10::Error, changing nothing, on a negative count or a gradient held where
/// copies[i] == 0.
void inspect_counted_once(const std::vector<at::Tensor>& grads, const std::vector<int>& copies,
                          const InspectOptions& options, const at::Tensor& head, LocalStats* stats,
                          DeferredBlame* blame);

}  // namespace inspect
}  // namespace stepguard
