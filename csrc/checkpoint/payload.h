/*
 * What one rank's disk checkpoint holds: named tensors (parameters, buffers, optimizer state), the
 * optimizer's opaque state bytes, the RNG states, and the guard's record (decision state, step,
 * data position, totals, skipped data ranges).
 *
 * Layout: an 8-byte magic, the header length (8 bytes, little endian), a JSON header describing
 * every tensor (name, dtype, shape, offset, bytes), then the raw bytes. Tensors are written
 * straight from their memory (no serialization copy); decoding reads views into the file's bytes.
 * The file layer (disk_checkpoint.h) adds the checksum and atomicity.
 *
 * Not here: putting the state back (the engine's recovery checks it against the live model first).
 * Torch-light (ATen tensors only). Not thread-safe.
 */
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "csrc/checkpoint/disk_checkpoint.h"
#include "csrc/checkpoint/named_tensors.h"
#include "csrc/checkpoint/rng_state.h"

namespace stepguard {
namespace checkpoint {

/// The payload format this build writes and reads (the header's "format").
constexpr int kPayloadFormat = 2;

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
  friend EncodedPayload encode_payload(const GuardRecord&, const std::vector<NamedTensor>&,
                                       const std::string&, const RngState&);
  std::string prefix_;  ///< magic, header length, header
  std::string opaque_;
  std::vector<at::Tensor> tensors_;  ///< contiguous host tensors, in file order
  Pieces pieces_;
};

/// Encodes this rank's state. Device tensors are copied to the host; host tensors are
/// referenced in place (do not change them before the payload is written).
EncodedPayload encode_payload(const GuardRecord& record, const std::vector<NamedTensor>& tensors,
                              const std::string& opaque, const RngState& rng);

/// A decoded payload; its tensors are views into `bytes`, which it keeps alive.
struct DecodedPayload {
  GuardRecord record;
  std::vector<NamedTensor> tensors;
  std::string opaque;
  RngState rng;
  std::shared_ptr<const std::string> bytes;
};

/// Reads and checks the layout of `bytes` (magic, format, header fields, every tensor's extent).
/// Changes nothing; throws CheckpointError naming `source` when the bytes do not fit.
DecodedPayload decode_payload(std::string bytes, const std::string& source);

}  // namespace checkpoint
}  // namespace stepguard
