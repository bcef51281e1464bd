// The fused inspection kernel. Host dispatch lives in inspect_cuda.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "csrc/common/cuda_check.h"
#include "csrc/core/stats.h"
#include "csrc/inspect/cuda/inspect_cuda.h"

namespace stepguard {
namespace cuda {
namespace {

using inspect::ChunkStats;
using inspect::Element;
using inspect::GradDtype;
using inspect::kThreadsPerChunk;

template <GradDtype DT>
__device__ __forceinline__ typename Element<DT>::Bits unscaled_bits(typename Element<DT>::Bits b,
                                                                    double inv_scale) {
  using Bits = typename Element<DT>::Bits;
  if (inspect::is_nonfinite<DT>(b)) return b;
  if constexpr (DT == GradDtype::kFloat32) {
    return __float_as_uint(__uint_as_float(b) * static_cast<float>(inv_scale));
  } else if constexpr (DT == GradDtype::kFloat64) {
    return static_cast<Bits>(
        __double_as_longlong(__longlong_as_double(static_cast<long long>(b)) * inv_scale));
  } else if constexpr (DT == GradDtype::kFloat16) {
    const float f = __half2float(__ushort_as_half(b)) * static_cast<float>(inv_scale);
    return __half_as_ushort(__float2half_rn(f));
  } else {
    const float f = __bfloat162float(__ushort_as_bfloat16(b)) * static_cast<float>(inv_scale);
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
}

// One chunk by one block; thread 0 gets the block's result.
template <GradDtype DT>
__device__ ChunkStats inspect_chunk_block(const cuda::ChunkDesc& chunk, double inv_scale,
                                          bool unscale, double* shared_sums,
                                          unsigned long long* shared_counts) {
  using E = Element<DT>;
  using Bits = typename E::Bits;
  constexpr int kSlots = inspect::kPacketBytes / sizeof(Bits);
  constexpr int kRow = kThreadsPerChunk * kSlots;
  Bits* p = reinterpret_cast<Bits*>(chunk.data) + chunk.begin;
  const std::int64_t n = chunk.count;
  const bool aligned = (reinterpret_cast<std::uintptr_t>(p) % inspect::kPacketBytes) == 0;

  double acc[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) acc[s] = 0.0;
  unsigned long long nonfinite = 0, nan = 0;
  for (std::int64_t first = static_cast<std::int64_t>(threadIdx.x) * kSlots; first < n;
       first += kRow) {
    Bits e[kSlots];
    const bool whole = aligned && first + kSlots <= n;
    if (whole) {
      const uint4 v = *reinterpret_cast<const uint4*>(p + first);
      memcpy(e, &v, sizeof v);
    } else {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) e[s] = first + s < n ? p[first + s] : Bits{0};
    }
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      if (first + s < n) {
        const inspect::ElementContribution c = inspect::contribution<DT>(e[s], inv_scale);
        acc[s] += c.square;
        nonfinite += c.nonfinite;
        nan += c.nan;
      }
    }
    if (unscale) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) e[s] = unscaled_bits<DT>(e[s], inv_scale);
      if (whole) {
        uint4 v;
        memcpy(&v, e, sizeof v);
        *reinterpret_cast<uint4*>(p + first) = v;
      } else {
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
          if (first + s < n) p[first + s] = e[s];
        }
      }
    }
  }
  shared_sums[threadIdx.x] = inspect::combine_slots(acc, kSlots);
  if (threadIdx.x == 0) shared_counts[0] = shared_counts[1] = 0;
  __syncthreads();
  atomicAdd(&shared_counts[0], nonfinite);  // integers: order does not matter
  atomicAdd(&shared_counts[1], nan);
  // The fixed tree of tree_sum_threads(), one level per step.
  for (int width = kThreadsPerChunk / 2; width > 0; width /= 2) {
    __syncthreads();
    if (threadIdx.x < width) shared_sums[threadIdx.x] += shared_sums[threadIdx.x + width];
  }
  __syncthreads();
  ChunkStats out;
  out.sum_squares = shared_sums[0];
  out.nan_count = static_cast<std::int64_t>(shared_counts[1]);
  out.inf_count = static_cast<std::int64_t>(shared_counts[0] - shared_counts[1]);
  __syncthreads();  // shared memory is reused by the next chunk
  return out;
}

__global__ void __launch_bounds__(kThreadsPerChunk)
    fused_inspect_kernel(const cuda::ChunkDesc* __restrict__ chunks, int num_chunks,
                         int num_tensors, double inv_scale, bool unscale,
                         ChunkStats* __restrict__ chunk_partials, unsigned int* done_counter,
                         cuda::DeviceResults results) {
  __shared__ double shared_sums[kThreadsPerChunk];
  __shared__ unsigned long long shared_counts[2];
  __shared__ bool last_block;
  for (int c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const cuda::ChunkDesc chunk = chunks[c];
    ChunkStats s;
    switch (static_cast<GradDtype>(chunk.dtype)) {
      case GradDtype::kFloat32:
        s = inspect_chunk_block<GradDtype::kFloat32>(chunk, inv_scale, unscale, shared_sums,
                                                     shared_counts);
        break;
      case GradDtype::kFloat16:
        s = inspect_chunk_block<GradDtype::kFloat16>(chunk, inv_scale, unscale, shared_sums,
                                                     shared_counts);
        break;
      case GradDtype::kBFloat16:
        s = inspect_chunk_block<GradDtype::kBFloat16>(chunk, inv_scale, unscale, shared_sums,
                                                      shared_counts);
        break;
      case GradDtype::kFloat64:
        s = inspect_chunk_block<GradDtype::kFloat64>(chunk, inv_scale, unscale, shared_sums,
                                                     shared_counts);
        break;
    }
    if (threadIdx.x == 0) chunk_partials[c] = s;
  }

  // The last block to finish reduces the partials in table order.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_block = atomicAdd(done_counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last_block || threadIdx.x != 0) return;
  __threadfence();
  double total = 0.0;
  long long nan = 0, inf = 0;
  int tensor = -1;
  double tensor_sum = 0.0;
  long long tensor_bad = 0;
  auto flush = [&]() {
    if (tensor < 0) return;
    if (results.tensor_sum_squares) results.tensor_sum_squares[tensor] = tensor_sum;
    if (results.tensor_nonfinite) results.tensor_nonfinite[tensor] = tensor_bad > 0 ? 1 : 0;
    total += tensor_sum;
  };
  // Tensors without chunks (no gradient, or empty) report zero.
  for (int t = 0; t < num_tensors; ++t) {
    if (results.tensor_sum_squares) results.tensor_sum_squares[t] = 0.0;
    if (results.tensor_nonfinite) results.tensor_nonfinite[t] = 0;
  }
  for (int c = 0; c < num_chunks; ++c) {
    const ChunkStats s = chunk_partials[c];
    if (chunks[c].tensor != tensor) {
      flush();
      tensor = chunks[c].tensor;
      tensor_sum = 0.0;
      tensor_bad = 0;
    }
    tensor_sum += s.sum_squares;
    tensor_bad += s.nan_count + s.inf_count;
    nan += s.nan_count;
    inf += s.inf_count;
  }
  flush();
  results.global[inspect_slot::kNanCount] = static_cast<double>(nan);
  results.global[inspect_slot::kInfCount] = static_cast<double>(inf);
  const bool overflow = !isfinite(total);
  results.global[inspect_slot::kSumSquares] = overflow ? 0.0 : total;
  results.global[inspect_slot::kSumSquaresOverflow] = overflow ? 1.0 : 0.0;
  *done_counter = 0;  // ready for the next launch (and for graph replay)
}

}  // namespace

void launch_fused_inspect(const ChunkDesc* chunks, int num_chunks, int num_tensors,
                          double inv_scale, bool unscale, inspect::ChunkStats* chunk_partials,
                          unsigned int* done_counter, DeviceResults results, int grid,
                          void* stream) {
  fused_inspect_kernel<<<grid, kThreadsPerChunk, 0, static_cast<cudaStream_t>(stream)>>>(
      chunks, num_chunks, num_tensors, inv_scale, unscale, chunk_partials, done_counter, results);
  SG_CUDA_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace stepguard
