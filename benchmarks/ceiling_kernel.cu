// The GPU bandwidth ceiling for bench_inspect_gpu: CUB's DeviceReduce::Sum over one flat buffer
// of the same bytes as the gradients (read as 32-bit words).
#include <cuda_runtime.h>
#include <cub/device/device_reduce.cuh>

#include "benchmarks/ceiling_kernel.h"
#include "csrc/common/cuda_check.h"

namespace stepguard {
namespace bench {

std::size_t cub_sum_temp_bytes(std::int64_t words) {
  std::size_t temp = 0;
  SG_CUDA_CHECK(cub::DeviceReduce::Sum(nullptr, temp, static_cast<const unsigned int*>(nullptr),
                                       static_cast<unsigned long long*>(nullptr),
                                       static_cast<int>(words)));
  return temp;
}

void cub_sum_words(const void* words, std::int64_t count, void* temp, std::size_t temp_bytes,
                   void* out, void* stream) {
  SG_CUDA_CHECK(cub::DeviceReduce::Sum(temp, temp_bytes, static_cast<const unsigned int*>(words),
                                       static_cast<unsigned long long*>(out),
                                       static_cast<int>(count), static_cast<cudaStream_t>(stream)));
}

}  // namespace bench
}  // namespace stepguard
