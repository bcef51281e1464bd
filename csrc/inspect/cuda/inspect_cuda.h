/*
 * The CUDA side of gradient inspection, behind a torch-free pointer API.
 *
 * One persistent launch covers every gradient: blocks (a few per SM) walk a chunk table kept in
 * device memory, each chunk is read with 16-byte vector loads (scalar loads, in the same lane
 * order, for a misaligned tensor or a partial packet at a tensor's end), squares accumulate in
 * fp64 in the order element_ops.h defines, and the last block to finish reduces the chunk
 * partials in table order: no second launch, no atomics on floating point, bitwise equal to the
 * CPU pass.
 *
 * Everything inspect() enqueues goes to the caller's stream: the launch, and on a table rebuild
 * (only when the set of gradients or the stream changes) the table copy from pinned host memory
 * and the done-counter reset. No host synchronization, no legacy-stream or device-wide call
 * (cudaMemcpy, cudaDeviceSynchronize; no cudaMalloc/cudaFree either when the DeviceAllocator is
 * PyTorch's caching allocator, as inspect_into() passes) and no change of the caller's current
 * device. In steady state a call is exactly one kernel on the stream, so it can be captured into
 * a CUDA graph; a rebuild cannot (it refuses to run while its stream is capturing): build the
 * table on the capture stream before capturing, and capture again when the gradients are
 * reallocated.
 *
 * Every function is callable in every build: without CUDA compiled in, or without a driver or
 * device, device_count() returns 0 and says why, and the others throw std::runtime_error.
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
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
  /// A finite element below zero counts as NaN (inspect::InspectOptions::nonnegative).
  bool nonnegative = false;
};

/// Where the kernel writes its results (device pointers; any may be null except `global`).
/// global[] = inspection's block of the step buffer, in stepguard::inspect_slot order (NaN count,
/// Inf count, sum of squares, overflow flag), so it is written in place.
struct DeviceResults {
  double* global = nullptr;
  double* tensor_sum_squares = nullptr;      ///< one per gradient
  std::int32_t* tensor_nonfinite = nullptr;  ///< one per gradient: 1 when it holds NaN/Inf
};

/// Device memory for an inspector's table and scratch: returns `bytes` (> 0) bytes of memory on the
/// inspector's device, 256-byte aligned, that stay valid until the last copy of the returned
/// pointer is dropped. It is called only from inspect(), with the inspector's device current and
/// with that call's stream being the stream the memory will be used on.
///
/// The inspector drops its memory on a rebuild (new gradient set or new stream) and on
/// destruction, while a kernel it launched on that stream may still read it. The allocator must
/// make that safe. cudaMalloc/cudaFree (the default, used when the hook is empty) are: cudaFree
/// waits for the device. PyTorch's caching allocator is, when the memory was allocated with the
/// inspection's stream as PyTorch's current stream (inspect_into() does so): it hands a freed
/// block out again only to allocations on that same stream, i.e. to work ordered after every
/// kernel that read it.
using DeviceAllocator = std::function<std::shared_ptr<void>(std::size_t bytes)>;

/// Owns the device chunk table and scratch for one set of gradients on one device and stream. Not
/// thread-safe: inspect_into() keeps one instance per device, stream and thread (thread_local),
/// shared by every guard on that thread, and rebuilds the table when the gradient set changes.
class FusedInspector {
 public:
  /// `allocate`: see DeviceAllocator; empty = cudaMalloc/cudaFree. Leaves the current device as
  /// it found it; allocates nothing (the first inspect() does, on its stream).
  explicit FusedInspector(int device, DeviceAllocator allocate = nullptr);
  ~FusedInspector();
  FusedInspector(const FusedInspector&) = delete;
  FusedInspector& operator=(const FusedInspector&) = delete;

  /// Enqueues the one launch on `stream` (a cudaStream_t; null = legacy default stream), after a
  /// table rebuild on that stream when the gradient set or the stream differs from the last call
  /// (the table, partials and done counter are then fresh, so calls on different streams never
  /// share scratch; the caller orders the gradients' producers before `stream`). Restores the
  /// caller's current device. Throws std::runtime_error when a rebuild is needed while `stream`
  /// is being captured into a CUDA graph. When `unscale` is set, finite elements are multiplied by
  /// inv_scale in place.
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
/// runs FusedInspector once (cudaMalloc/cudaFree memory) on `stream` (a cudaStream_t of device 0;
/// null = legacy default stream), and returns the global result and per-tensor sums. Every copy
/// goes to `stream`, which it synchronizes; restores the caller's current device.
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
                                      std::size_t misalign_bytes = 0, void* stream = nullptr);

// Defined in the .cu file.
struct ChunkDesc {
  std::uint64_t data;        ///< device address of the tensor's first element
  std::int64_t begin;        ///< first element of the chunk
  std::int64_t count;        ///< elements in the chunk
  std::int32_t tensor;       ///< index into the gradient list
  std::int32_t dtype;        ///< inspect::GradDtype
  std::int32_t nonnegative;  ///< 1: a finite element below zero counts as NaN
  std::int32_t unused;
};
/// Blocks of the fused kernel that fit on one SM of the current device at once (at least 1), from
/// cudaOccupancyMaxActiveBlocksPerMultiprocessor on the kernel itself. Throws on a CUDA error.
int fused_inspect_blocks_per_sm();
void launch_fused_inspect(const ChunkDesc* chunks, int num_chunks, int num_tensors,
                          double inv_scale, bool unscale, inspect::ChunkStats* chunk_partials,
                          unsigned int* done_counter, DeviceResults results, int grid,
                          void* stream);

}  // namespace cuda
}  // namespace stepguard
