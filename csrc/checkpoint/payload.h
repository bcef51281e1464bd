/*
 * What one rank's disk checkpoint holds: parameters, optimizer state, RNG states, the guard's
 * decision state, step, data position, totals and skipped data ranges.
 *
 * Layout: an 8-byte magic, the header length (8 bytes, little endian), a JSON header describing
 * every tensor (dtype, shape, offset, bytes), then the raw tensor bytes. Tensors are written
 * straight from their memory (no serialization copy) and read back into the model's own buffers.
 * Optimizer state is stored field by field for LibTorch's Adam, AdamW, SGD, Adagrad and RMSprop;
 * any other optimizer is stored as its own serialize archive. The file layer (disk_checkpoint.h)
 * adds the checksum and atomicity.
 *
 * Not thread-safe.
 */
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/checkpoint/disk_checkpoint.h"

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

/// An encoded payload: the pieces of the file and what keeps their memory alive.
class EncodedPayload {
 public:
  const Pieces& pieces() const noexcept { return pieces_; }

 private:
  friend EncodedPayload encode_payload(const GuardRecord&, const std::vector<at::Tensor>&,
                                       const torch::optim::Optimizer&);
  std::string prefix_;  ///< magic, header length, header
  std::string archive_;
  std::vector<at::Tensor> tensors_;  ///< contiguous host tensors, in file order
  Pieces pieces_;
};

/// Encodes this rank's state after `record.step`. Device tensors are copied to the host;
/// host tensors are referenced in place (do not change them before the payload is written).
EncodedPayload encode_payload(const GuardRecord& record, const std::vector<at::Tensor>& params,
                              const torch::optim::Optimizer& optimizer);

/// Restores parameters, optimizer state and RNG from `bytes` and returns the guard's record.
/// Everything is read and checked (layout, parameter count, shapes, dtypes, optimizer type)
/// before anything changes; throws CheckpointError naming `source` when the bytes do not fit.
GuardRecord decode_payload(const std::string& bytes, const std::string& source,
                           const std::vector<at::Tensor>& params,
                           torch::optim::Optimizer& optimizer);

}  // namespace checkpoint
}  // namespace stepguard
