/*
 * The random streams training draws from (the CPU generator and one per visible CUDA device):
 * captured and restored in one place, for RAM snapshots, disk checkpoints and forensic replays.
 *
 * Thread-safety: capture and restore lock each generator's own mutex.
 */
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace stepguard {
namespace checkpoint {

struct RngState {
  at::Tensor cpu;                ///< the CPU generator's state (a uint8 tensor)
  std::vector<at::Tensor> cuda;  ///< one per visible device, when CUDA is available
  bool empty() const noexcept { return !cpu.defined(); }
};

/// The generators' states now.
RngState capture_rng();
/// Sets the generators back; devices beyond those visible now are ignored. An empty state does
/// nothing.
void restore_rng(const RngState& state);
/// Throws c10::Error naming the generator when torch would refuse `state` (a CPU state of the
/// right size that is not a valid mt19937 state): tried on a scratch generator, so nothing of
/// training's changes. CUDA states are checked by size only (by the caller).
void check_rng(const RngState& state);
/// The number of CUDA devices whose generators are captured (0 without CUDA).
int rng_cuda_devices();

}  // namespace checkpoint
}  // namespace stepguard
