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

// Rows (one 16-byte packet per thread each) loaded before the first of them is accumulated, so
// each thread keeps several loads in flight. A full chunk holds 32 (16-bit), 64 (fp32) or 128
// (fp64) rows, a multiple of this.
constexpr int kRowsInFlight = 4;
// Chunks the last block stages in shared memory per step of its reduction.
constexpr int kTileChunks = 1024;
constexpr int kTilePerThread = kTileChunks / kThreadsPerChunk;
constexpr int kWarps = kThreadsPerChunk / 32;
static_assert(kThreadsPerChunk % 32 == 0, "whole warps");
static_assert(kTileChunks % kThreadsPerChunk == 0 && kTilePerThread <= 32,
              "each thread owns a bit mask's worth of tile positions");
static_assert(kTileChunks <= 65535, "tile positions are stored as 16-bit");

// Shared memory, reused: the chunk phase and the last block's reduction never overlap (a
// __syncthreads() separates them), so the block's static footprint is the larger of the two.
union SharedStorage {
  struct {
    double sums[kThreadsPerChunk];
    unsigned long long counts[2];
  } chunk;
  struct {
    double sum[kTileChunks];  ///< chunk partial sums; at a completed run's start, the tensor's sum
    std::int32_t tensor[kTileChunks + 1];  ///< [n]: the next tile's first tensor, or -1 at the end
    std::uint16_t done[kTileChunks];       ///< starts of the runs that complete a tensor, in order
    std::uint8_t bad[kTileChunks];         ///< the chunk holds NaN or Inf
  } tile;
};

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

// 1 when the unscale turned a finite element into Inf (the product past the dtype's largest
// value): it counts as non-finite, so a step never applies a value the inspection did not see.
template <GradDtype DT>
__device__ __forceinline__ unsigned long long made_nonfinite(typename Element<DT>::Bits before,
                                                             typename Element<DT>::Bits after) {
  return !inspect::is_nonfinite<DT>(before) && inspect::is_nonfinite<DT>(after) ? 1ull : 0ull;
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
  unsigned long long nonfinite = 0, nan = 0, negative = 0;
  const bool nonnegative = chunk.nonnegative != 0;
  std::int64_t first = static_cast<std::int64_t>(threadIdx.x) * kSlots;
  // Whole groups of kRowsInFlight aligned, complete packets: all loads first, then the rows in
  // order. Each slot accumulator sees the same values in the same order as the one-row loop
  // below (which these rows would take with whole == true and every slot in range), so the bits
  // do not change. The thread owns these packets alone, so loading row r + 1 before storing the
  // unscaled row r reads the same values.
  if (aligned) {
    for (; first + (kRowsInFlight - 1) * kRow + kSlots <= n; first += kRowsInFlight * kRow) {
      uint4 v[kRowsInFlight];
#pragma unroll
      for (int r = 0; r < kRowsInFlight; ++r) {
        v[r] = *reinterpret_cast<const uint4*>(p + first + r * kRow);
      }
      // One row at a time, rotating the packets down so v[] stays in registers. Fully unrolled,
      // the compiler interleaves the rows' fp64 math: ~105 registers (2 blocks/SM) instead of 64
      // (4 blocks/SM, as many as before this change).
#pragma unroll 1
      for (int r = 0; r < kRowsInFlight; ++r) {
        Bits e[kSlots];
        memcpy(e, &v[0], sizeof v[0]);
#pragma unroll
        for (int q = 0; q + 1 < kRowsInFlight; ++q) v[q] = v[q + 1];
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
          const inspect::ElementContribution c = inspect::contribution<DT>(e[s], inv_scale);
          acc[s] += c.square;
          nonfinite += c.nonfinite;
          nan += c.nan;
        }
        if (nonnegative) {
#pragma unroll
          for (int s = 0; s < kSlots; ++s) negative += inspect::negative_finite<DT>(e[s]);
        }
        if (unscale) {
#pragma unroll
          for (int s = 0; s < kSlots; ++s) {
            const Bits u = unscaled_bits<DT>(e[s], inv_scale);
            nonfinite += made_nonfinite<DT>(e[s], u);
            e[s] = u;
          }
          uint4 u;
          memcpy(&u, e, sizeof u);
          *reinterpret_cast<uint4*>(p + first + r * kRow) = u;
        }
      }
    }
  }
  // The rest one row at a time: a misaligned tensor, and the last rows of a chunk.
  for (; first < n; first += kRow) {
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
        if (nonnegative) negative += inspect::negative_finite<DT>(e[s]);
      }
    }
    if (unscale) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const Bits u = unscaled_bits<DT>(e[s], inv_scale);
        if (first + s < n) nonfinite += made_nonfinite<DT>(e[s], u);
        e[s] = u;
      }
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
  // A negative element of a nonnegative tensor counts as NaN, as on the CPU.
  nonfinite += negative;
  nan += negative;
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

// The last block's reduction of the chunk partials, by all its threads, with the bits of the
// sequential walk (per tensor: 0.0 + its chunks' sums in chunk order; total: 0.0 + the sums of
// the tensors that have chunks, in tensor order).
//
// Chunks are staged kTileChunks at a time in shared memory. Within a tile, a run is a maximal
// stretch of chunks of one tensor (chunks are sorted by tensor, and a tensor's chunks are
// contiguous and in order); the thread owning a run's first position adds the run up serially in
// chunk order, starting from the carry when the run continues a tensor from the previous tile,
// and leaves a carry when it goes on into the next tile. Each tensor's sum is therefore one
// sequential chain, as before, but different tensors' chains run in parallel.
//
// The global total stays a sequential sum over tensors, by thread 0: a floating-point sequence
// sum cannot be regrouped (as a tree or by warp shuffles) without changing its rounding, and so
// its bits. What is parallel is everything around it: the completed tensors' sums are compacted
// in tensor order in shared memory (a block scan), so thread 0 runs one dependent add per tensor
// over shared memory, with no search, branch or global load in the chain. That chain (about one
// fp64 add latency per tensor with chunks, some 0.1 ms for 20k tensors) is the floor that bitwise
// equality with the CPU's sequential total sets.
// NaN/Inf counts are integers and are summed in any order.
__device__ void reduce_partials(const cuda::ChunkDesc* __restrict__ chunks, int num_chunks,
                                int num_tensors, const ChunkStats* chunk_partials,
                                unsigned int* done_counter, const cuda::DeviceResults& results,
                                SharedStorage& smem) {
  __shared__ std::int32_t carry_tensor[2];  // double-buffered by tile parity
  __shared__ double carry_sum[2];
  __shared__ std::int32_t carry_bad[2];
  __shared__ int warp_done[kWarps];
  __shared__ unsigned long long counts[2];
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;

  // Tensors without chunks (no gradient, or empty) report zero. The tiles overwrite the others:
  // the __syncthreads() below orders these stores before theirs.
  for (int t = tid; t < num_tensors; t += kThreadsPerChunk) {
    if (results.tensor_sum_squares) results.tensor_sum_squares[t] = 0.0;
    if (results.tensor_nonfinite) results.tensor_nonfinite[t] = 0;
  }
  if (tid == 0) {
    carry_tensor[0] = carry_tensor[1] = -1;
    counts[0] = counts[1] = 0;
  }
  __syncthreads();

  unsigned long long my_nan = 0, my_inf = 0;
  double total = 0.0;  // thread 0's
  // Uniform trip count: every __syncthreads() below is reached by all threads.
  for (int c0 = 0, tile = 0; c0 < num_chunks; c0 += kTileChunks, ++tile) {
    const int n = min(kTileChunks, num_chunks - c0);
    const int cur = tile & 1;
    const int next = cur ^ 1;

    // Stage the tile (coalesced). L2 loads: the partials were written by other blocks.
    for (int j = tid; j < n; j += kThreadsPerChunk) {
      const ChunkStats* s = chunk_partials + c0 + j;
      const long long nan = __ldcg(reinterpret_cast<const long long*>(&s->nan_count));
      const long long inf = __ldcg(reinterpret_cast<const long long*>(&s->inf_count));
      smem.tile.sum[j] = __ldcg(&s->sum_squares);
      smem.tile.bad[j] = nan + inf > 0 ? 1 : 0;
      smem.tile.tensor[j] = chunks[c0 + j].tensor;
      my_nan += static_cast<unsigned long long>(nan);
      my_inf += static_cast<unsigned long long>(inf);
    }
    if (tid == 0) smem.tile.tensor[n] = c0 + n < num_chunks ? chunks[c0 + n].tensor : -1;
    __syncthreads();

    // One thread per run, for the runs starting at its kTilePerThread consecutive positions.
    // A thread reads only its own runs' positions, so it may overwrite its runs' first sums.
    unsigned int done_mask = 0;
    for (int q = 0; q < kTilePerThread; ++q) {
      const int j = tid * kTilePerThread + q;
      if (j >= n) break;
      const std::int32_t t = smem.tile.tensor[j];
      if (j > 0 && smem.tile.tensor[j - 1] == t) continue;  // inside a run
      double sum = 0.0;
      std::int32_t bad = 0;
      if (j == 0 && carry_tensor[cur] == t) {  // only thread 0 reads the carry
        sum = carry_sum[cur];
        bad = carry_bad[cur];
      }
      // The run's end: the tile is sorted by tensor, so a binary search for the first position
      // past t (a single chunk, the common small-tensor case, needs one look). Knowing the trip
      // count lets the loop below issue its loads ahead of the dependent adds.
      int end = j + 1;
      if (end < n && smem.tile.tensor[end] == t) {
        int hi = n;
        while (end < hi) {
          const int mid = (end + hi) / 2;
          if (smem.tile.tensor[mid] <= t) {
            end = mid + 1;
          } else {
            hi = mid;
          }
        }
      }
#pragma unroll 4
      for (int k = j; k < end; ++k) {  // chunk order: the sequential walk's adds
        sum += smem.tile.sum[k];
        bad |= smem.tile.bad[k];
      }
      if (end == n && smem.tile.tensor[n] == t) {  // the tensor goes on in the next tile
        carry_tensor[next] = t;
        carry_sum[next] = sum;
        carry_bad[next] = bad;
      } else {
        if (results.tensor_sum_squares) results.tensor_sum_squares[t] = sum;
        if (results.tensor_nonfinite) results.tensor_nonfinite[t] = bad;
        smem.tile.sum[j] = sum;
        done_mask |= 1u << q;
      }
    }
    // Consumed. Slot `cur` is next written in the next tile (as its `next`), after the barriers
    // below, and read two tiles on; left at -1 when no run carries.
    if (tid == 0) carry_tensor[cur] = -1;

    // Compact the completed tensors' starts in position (= tensor) order: exclusive scan of the
    // per-thread counts, threads owning ascending positions. Converged code: full-mask shuffles.
    const int mine = __popc(done_mask);
    int inclusive = mine;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += v;
    }
    if (lane == 31) warp_done[warp] = inclusive;
    __syncthreads();
    int offset = inclusive - mine;
    int done = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) offset += warp_done[w];
      done += warp_done[w];
    }
    for (unsigned int m = done_mask; m != 0; m &= m - 1) {
      smem.tile.done[offset++] = static_cast<std::uint16_t>(tid * kTilePerThread + __ffs(m) - 1);
    }
    __syncthreads();

    // The sequential total over tensors, in tensor order (see above).
    if (tid == 0) {
#pragma unroll 4
      for (int i = 0; i < done; ++i) total += smem.tile.sum[smem.tile.done[i]];
    }
    __syncthreads();  // the next tile overwrites the staging arrays and warp_done
  }

  atomicAdd(&counts[0], my_nan);  // integers: order does not matter
  atomicAdd(&counts[1], my_inf);
  __syncthreads();
  if (tid == 0) {
    results.global[inspect_slot::kNanCount] = static_cast<double>(counts[0]);
    results.global[inspect_slot::kInfCount] = static_cast<double>(counts[1]);
    const bool overflow = !isfinite(total);
    results.global[inspect_slot::kSumSquares] = overflow ? 0.0 : total;
    results.global[inspect_slot::kSumSquaresOverflow] = overflow ? 1.0 : 0.0;
    *done_counter = 0;  // ready for the next launch (and for graph replay)
  }
}

__global__ void __launch_bounds__(kThreadsPerChunk)
    fused_inspect_kernel(const cuda::ChunkDesc* __restrict__ chunks, int num_chunks,
                         int num_tensors, double inv_scale, bool unscale,
                         ChunkStats* __restrict__ chunk_partials, unsigned int* done_counter,
                         cuda::DeviceResults results) {
  __shared__ SharedStorage smem;
  __shared__ bool last_block;
  double* const shared_sums = smem.chunk.sums;
  unsigned long long* const shared_counts = smem.chunk.counts;
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

  // The last block to finish reduces the partials. Every thread's partial stores are fenced
  // before thread 0 bumps the counter; the block whose bump completes the count sees them all.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_block = atomicAdd(done_counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last_block) return;  // uniform over the block
  __threadfence();          // every reading thread orders its loads after the counter
  reduce_partials(chunks, num_chunks, num_tensors, chunk_partials, done_counter, results, smem);
}

}  // namespace

int fused_inspect_blocks_per_sm() {
  int blocks = 0;
  SG_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fused_inspect_kernel,
                                                              kThreadsPerChunk, 0));
  return blocks > 0 ? blocks : 1;
}

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
