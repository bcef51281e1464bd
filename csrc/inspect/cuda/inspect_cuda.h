/*
 * The CUDA side of gradient inspection, behind a torch-free pointer API. Every function here is
 * callable in every build: without CUDA compiled in, or without a driver or device at run time,
 * device_count() returns 0 and says why, and the other functions throw.
 *
 * This file holds the single-buffer kernel that proves the toolchain end to end; the fused
 * multi-tensor kernel replaces it (see the inspection issue).
 */
#pragma once

#include <cstdint>
#include <string>

#include "csrc/inspect/element_ops.h"

namespace stepguard {
namespace cuda {

/// True when this build compiled the CUDA path (nvcc and NCCL were found at configure time).
bool compiled_with_cuda() noexcept;

/// Number of usable CUDA devices. Returns 0 and fills `why` (when given) with the reason when the
/// build has no CUDA, the driver is missing or no device is present. Never throws.
int device_count(std::string* why = nullptr) noexcept;

/// Copies `n` host floats to device 0, runs the inspection kernel (the per-element code of
/// element_ops.h) and returns its counts and fp64 sum of squares. Throws std::runtime_error when
/// CUDA is unavailable or a CUDA call fails.
inspect::ChunkStats inspect_host_f32_on_device(const float* host, std::int64_t n,
                                               double inv_scale = 1.0);

/// Launches the kernel on device memory: `partials` must hold `num_blocks` ChunkStats on the
/// device. Block b reduces its elements in a fixed order; the caller sums partials in index order.
/// Defined in the .cu file; `stream` is a cudaStream_t.
void launch_inspect_f32(const float* device_data, std::int64_t n, double inv_scale,
                        inspect::ChunkStats* partials, int num_blocks, void* stream);

}  // namespace cuda
}  // namespace stepguard
