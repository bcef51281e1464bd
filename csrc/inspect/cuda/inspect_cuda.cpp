// Host dispatch for the CUDA inspection path, in plain C++.
#include "csrc/inspect/cuda/inspect_cuda.h"

#include <stdexcept>
#include <vector>

#if defined(STEPGUARD_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "csrc/common/cuda_check.h"
#endif

namespace stepguard {
namespace cuda {

bool compiled_with_cuda() noexcept {
#if defined(STEPGUARD_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

int device_count(std::string* why) noexcept {
#if defined(STEPGUARD_WITH_CUDA)
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why) *why = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return 0;
  }
  if (count == 0 && why) *why = "the CUDA driver reports no device";
  return count;
#else
  if (why) *why = "stepguard was built without CUDA (no nvcc or NCCL at configure time)";
  return 0;
#endif
}

#if defined(STEPGUARD_WITH_CUDA)
namespace {
// Frees device memory on every path out, including exceptions.
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(std::size_t bytes) { SG_CUDA_CHECK(cudaMalloc(&ptr, bytes)); }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};
}  // namespace
#endif

inspect::ChunkStats inspect_host_f32_on_device(const float* host, std::int64_t n,
                                               double inv_scale) {
#if defined(STEPGUARD_WITH_CUDA)
  std::string why;
  if (device_count(&why) == 0) throw std::runtime_error("stepguard: no CUDA device: " + why);
  SG_CUDA_CHECK(cudaSetDevice(0));
  constexpr int kBlocks = 64;
  DeviceBuffer data(static_cast<std::size_t>(n > 0 ? n : 1) * sizeof(float));
  DeviceBuffer partials(kBlocks * sizeof(inspect::ChunkStats));
  if (n > 0) {
    SG_CUDA_CHECK(cudaMemcpy(data.ptr, host, n * sizeof(float), cudaMemcpyHostToDevice));
  }
  launch_inspect_f32(static_cast<const float*>(data.ptr), n, inv_scale,
                     static_cast<inspect::ChunkStats*>(partials.ptr), kBlocks, nullptr);
  std::vector<inspect::ChunkStats> host_partials(kBlocks);
  SG_CUDA_CHECK(cudaMemcpy(host_partials.data(), partials.ptr,
                           kBlocks * sizeof(inspect::ChunkStats), cudaMemcpyDeviceToHost));
  inspect::ChunkStats total;
  for (const auto& p : host_partials) {
    total.sum_squares += p.sum_squares;
    total.nan_count += p.nan_count;
    total.inf_count += p.inf_count;
  }
  return total;
#else
  (void)host;
  (void)n;
  (void)inv_scale;
  throw std::runtime_error("stepguard: built without CUDA");
#endif
}

}  // namespace cuda
}  // namespace stepguard
