/*
 * Forensic replays: the offending batch recomputed from the pre-step state through the training
 * loop's own closure, as is, in fp32 and under autograd anomaly mode (whose error names the op
 * that made the first NaN in backward). What they show goes into the Evidence.
 *
 * Not here: deciding anything from it (classifier.h), or when to replay (the engine: once per
 * streak of bad steps). Not thread-safe: the training thread runs them.
 */
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "csrc/core/vocabulary.h"
#include "csrc/forensics/classifier.h"

namespace stepguard {
namespace forensics {

/// Recomputes the step's loss from the same batch and runs backward; returns the loss.
using Recompute = std::function<at::Tensor(ReplayMode)>;

/// Replays into `ev` (rerun, fp32, anomaly_op, anomaly_message): as is; in fp32 when loss scaling
/// is on and the rerun reproduced; under anomaly mode when the rerun reproduced. `before_each`
/// runs before every replay (the engine restores the forward pass's random streams there);
/// gradients of `params` are zeroed before and inspected after each replay.
void run_replays(const Recompute& recompute, const std::function<void()>& before_each,
                 const std::vector<at::Tensor>& params, bool loss_scaling, Evidence* ev);

}  // namespace forensics
}  // namespace stepguard
