/*
 * The CUDA side of gradient inspection, behind a torch-free pointer API.
 *
 * One persistent launch covers every gradient: blocks (a few per SM) walk a chunk table kept in
 * device memory, each chunk is read with 16-byte vector loads (scalar loads, in the same lane
 * order, for a misaligned tensor or a partial packet at a tensor's end), squares accumulate in
 * fp64 in the order element_ops.h defines, and the last block to finish reduces the chunk
 * partials in table order: no second launch, no atomics on floating point, bitwise equal to the
 * CPU pass. The table is rebuilt only when the set of gradients changes, so a captured CUDA graph
 * stays valid. No host synchronization happens inside inspect().
 *
 * Every function is callable in every build: without CUDA compiled in, or without a driver or
 * device, device_count() returns 0 and says why, and the others throw std::runtime_error.
 */
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "csrc/inspect/element_ops.h"

namespace stepguard {
namespace cuda {

/// True when this build compiled the CUDA path (nvcc and NCCL were found at configure time).
bool compiled_with_cuda() noexcept;

/// Number of usable CUDA devices. Returns 0 and fills `why` (when given) with the reason when the
/// build has no CUDA, the driver is missing or no device is present. Never throws.
int device_count(std::string* why = nullptr) noexcept;

/// One gradient as the kernel sees it. `data` is a device pointer (may be null when numel is 0).
struct DeviceGradient {
  void* data = nullptr;
  std::int64_t numel = 0;
  inspect::GradDtype dtype = inspect::GradDtype::kFloat32;
};

/// Where the kernel writes its results (device pointers; any may be null except `global`).
/// global[] = inspection's block of the step buffer, in stepguard::inspect_slot order (NaN count,
/// Inf count, sum of squares, overflow flag), so it is written in place.
struct DeviceResults {
  double* global = nullptr;
  double* tensor_sum_squares = nullptr;      ///< one per gradient
  std::int32_t* tensor_nonfinite = nullptr;  ///< one per gradient: 1 when it holds NaN/Inf
};

/// Owns the device chunk table and scratch for one set of gradients on one device. Not
/// thread-safe: inspect_into() keeps one instance per device and thread (thread_local), shared by
/// every guard on that thread, and rebuilds the table when the gradient set changes.
class FusedInspector {
 public:
  explicit FusedInspector(int device);
  ~FusedInspector();
  FusedInspector(const FusedInspector&) = delete;
  FusedInspector& operator=(const FusedInspector&) = delete;

  /// Enqueues the one launch on `stream` (a cudaStream_t; null = legacy default stream).
  /// When `unscale` is set, finite elements are multiplied by inv_scale in place.
  void inspect(const std::vector<DeviceGradient>& grads, double inv_scale, bool unscale,
               const DeviceResults& results, void* stream);

  /// Kernel launches so far (one per inspect() call with at least one element).
  std::int64_t launches() const noexcept;
  /// Times the chunk table was (re)built.
  std::int64_t table_builds() const noexcept;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// Test and benchmark helper: copies host gradients (raw bits, in the given dtypes) to device 0,
/// runs FusedInspector once, and returns the global result and per-tensor sums. Synchronizes.
struct HostInspection {
  inspect::ChunkStats global;
  bool overflow = false;
  std::vector<double> tensor_sum_squares;
  std::vector<std::int32_t> tensor_nonfinite;
  std::vector<std::vector<std::uint8_t>> unscaled;  ///< the gradients' bytes after the launch
};
HostInspection inspect_host_on_device(const std::vector<std::vector<std::uint8_t>>& bytes,
                                      const std::vector<inspect::GradDtype>& dtypes,
                                      double inv_scale = 1.0, bool unscale = false,
                                      std::size_t misalign_bytes = 0);

// Defined in the .cu file.
struct ChunkDesc {
  std::uint64_t data;   ///< device address of the tensor's first element
  std::int64_t begin;   ///< first element of the chunk
  std::int64_t count;   ///< elements in the chunk
  std::int32_t tensor;  ///< index into the gradient list
  std::int32_t dtype;   ///< inspect::GradDtype
};
void launch_fused_inspect(const ChunkDesc* chunks, int num_chunks, int num_tensors,
                          double inv_scale, bool unscale, inspect::ChunkStats* chunk_partials,
                          unsigned int* done_counter, DeviceResults results, int grid,
                          void* stream);

}  // namespace cuda
}  // namespace stepguard
