// Kernels only; host dispatch lives in inspect_cuda.cpp.
#include <cuda_runtime.h>

#include "csrc/common/cuda_check.h"
#include "csrc/inspect/cuda/inspect_cuda.h"

namespace stepguard {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__global__ void inspect_f32_kernel(const float* __restrict__ data, std::int64_t n, double inv_scale,
                                   inspect::ChunkStats* partials) {
  __shared__ double sums[kThreads];
  __shared__ long long nans[kThreads];
  __shared__ long long infs[kThreads];
  inspect::ChunkStats acc;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const std::uint32_t bits = __float_as_uint(data[i]);
    inspect::add_element(acc, inspect::classify_f32(bits), static_cast<double>(data[i]), inv_scale);
  }
  sums[threadIdx.x] = acc.sum_squares;
  nans[threadIdx.x] = acc.nan_count;
  infs[threadIdx.x] = acc.inf_count;
  __syncthreads();
  // Fixed-shape tree: the same order on every launch.
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) {
      sums[threadIdx.x] += sums[threadIdx.x + width];
      nans[threadIdx.x] += nans[threadIdx.x + width];
      infs[threadIdx.x] += infs[threadIdx.x + width];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    partials[blockIdx.x].sum_squares = sums[0];
    partials[blockIdx.x].nan_count = nans[0];
    partials[blockIdx.x].inf_count = infs[0];
  }
}

}  // namespace

void launch_inspect_f32(const float* device_data, std::int64_t n, double inv_scale,
                        inspect::ChunkStats* partials, int num_blocks, void* stream) {
  inspect_f32_kernel<<<num_blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      device_data, n, inv_scale, partials);
  SG_CUDA_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace stepguard
