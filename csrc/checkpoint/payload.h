/*
 * What one rank's disk checkpoint holds, as bytes: parameters, the optimizer's own archive, the
 * RNG states, the guard's decision state, step, data position, totals and skipped data ranges.
 * The format is LibTorch's serialize archive; the file layer (disk_checkpoint.h) adds the
 * checksum and atomicity.
 *
 * Not thread-safe.
 */
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace stepguard {
namespace checkpoint {

/// The guard's side of a checkpoint (the tensors travel separately).
struct GuardRecord {
  std::int64_t step = 0;
  std::int64_t data_position = 0;            ///< batches consumed, skips included
  std::vector<std::int64_t> guard;           ///< the decision state (StepController words)
  std::vector<std::int64_t> totals;          ///< the guard's counters, opaque here
  std::vector<std::int64_t> skipped_ranges;  ///< (first batch, count) pairs, oldest first
};

/// Serializes this rank's state after `record.step`.
std::string encode_payload(const GuardRecord& record, const std::vector<at::Tensor>& params,
                           const torch::optim::Optimizer& optimizer);

/// Restores parameters, optimizer state and RNG from `bytes` and returns the guard's record.
/// Parameters are checked (count, shapes, dtypes) before anything changes; throws
/// CheckpointError naming `source` when the bytes do not fit this model.
GuardRecord decode_payload(const std::string& bytes, const std::string& source,
                           const std::vector<at::Tensor>& params,
                           torch::optim::Optimizer& optimizer);

}  // namespace checkpoint
}  // namespace stepguard
