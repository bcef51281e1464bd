/*
 * Per-element and per-chunk gradient inspection, shared by the CPU path and the CUDA kernel so
 * that the CPU tests exercise the very code the GPU runs. Torch-free: plain bits and pointers.
 *
 * Non-finite values are found by exponent-bit tests rather than isfinite(), so fast-math flags
 * cannot fold the check away. Squares accumulate in fp64 in a fixed order per chunk.
 */
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SG_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SG_HOST_DEVICE inline
#endif

namespace stepguard {
namespace inspect {

/// Gradient element types the inspection understands.
enum class GradDtype : std::int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

/// Elements per chunk: the unit of parallel work and of the fixed reduction order. A multiple of
/// every dtype's row length (lanes_per_row), so rows never straddle chunks.
constexpr std::int64_t kChunkElements = std::int64_t{1} << 16;

SG_HOST_DEVICE float bits_to_f32(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
SG_HOST_DEVICE double bits_to_f64(std::uint64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}
SG_HOST_DEVICE std::uint32_t f32_to_bits(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

/// Partial results of one chunk. Chunks combine in index order only.
struct ChunkStats {
  double sum_squares = 0.0;
  std::int64_t nan_count = 0;
  std::int64_t inf_count = 0;
};

// ---------------------------------------------------------------------------------------------
// The reduction order, shared by the CPU pass and the CUDA kernel so both give the same bits.
//
// A chunk is processed in rows of kThreadsPerChunk 16-byte packets. Thread t of the GPU block owns
// packet t of every row and keeps one fp64 accumulator per element slot of its packet; on the CPU
// those accumulators are the "lanes" (lane = element index within the row), added to in the same
// order. At the end of the chunk each thread's slots are combined pairwise, then the threads'
// values by a fixed binary tree. The order depends only on element positions, never on the
// number of CPU threads or GPU blocks.
// ---------------------------------------------------------------------------------------------

/// GPU threads per chunk; CPU lanes are grouped the same way.
constexpr int kThreadsPerChunk = 256;
/// Bytes per vector load.
constexpr int kPacketBytes = 16;
/// Largest number of lanes (16-bit elements: 8 per packet).
constexpr int kMaxLanes = kThreadsPerChunk * 8;

SG_HOST_DEVICE int element_bytes(GradDtype dtype) {
  return dtype == GradDtype::kFloat32 ? 4 : dtype == GradDtype::kFloat64 ? 8 : 2;
}
/// Elements per 16-byte packet: 4 (fp32), 8 (fp16, bf16), 2 (fp64).
SG_HOST_DEVICE int elements_per_packet(GradDtype dtype) {
  return kPacketBytes / element_bytes(dtype);
}
/// Elements per row of a chunk.
SG_HOST_DEVICE int lanes_per_row(GradDtype dtype) {
  return kThreadsPerChunk * elements_per_packet(dtype);
}

/// Combines one thread's `n` slot accumulators (n = 2, 4 or 8) pairwise, in place; returns the sum.
SG_HOST_DEVICE double combine_slots(double* slots, int n) {
  for (int width = n / 2; width > 0; width /= 2) {
    for (int i = 0; i < width; ++i) slots[i] += slots[i + width];
  }
  return slots[0];
}

/// Sums kThreadsPerChunk values by the fixed tree the GPU block uses, in place.
SG_HOST_DEVICE double tree_sum_threads(double* values) {
  for (int width = kThreadsPerChunk / 2; width > 0; width /= 2) {
    for (int i = 0; i < width; ++i) values[i] += values[i + width];
  }
  return values[0];
}

/// Element traits: the raw bit type and the magnitude of a finite element as double.
/// Non-finite elements are told apart by exponent bits alone.
template <GradDtype DT>
struct Element;

template <>
struct Element<GradDtype::kFloat32> {
  using Bits = std::uint32_t;
  SG_HOST_DEVICE static bool nonfinite(Bits b) { return (b & 0x7f800000u) == 0x7f800000u; }
  SG_HOST_DEVICE static bool nan(Bits b) { return nonfinite(b) && (b & 0x007fffffu) != 0; }
  SG_HOST_DEVICE static double magnitude(Bits b) {
    return static_cast<double>(bits_to_f32(b & 0x7fffffffu));
  }
};

template <>
struct Element<GradDtype::kFloat64> {
  using Bits = std::uint64_t;
  SG_HOST_DEVICE static bool nonfinite(Bits b) {
    return (b & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
  }
  SG_HOST_DEVICE static bool nan(Bits b) {
    return nonfinite(b) && (b & 0x000fffffffffffffull) != 0;
  }
  SG_HOST_DEVICE static double magnitude(Bits b) { return bits_to_f64(b & 0x7fffffffffffffffull); }
};

template <>
struct Element<GradDtype::kFloat16> {
  using Bits = std::uint16_t;
  SG_HOST_DEVICE static bool nonfinite(Bits b) { return (b & 0x7c00u) == 0x7c00u; }
  SG_HOST_DEVICE static bool nan(Bits b) { return nonfinite(b) && (b & 0x03ffu) != 0; }
  // Branch-free and exact: (implicit + mantissa) * 2^(max(exponent, 1) - 25), the power of two
  // built from bits. Subnormals (exponent 0) have no implicit bit and exponent 1.
  SG_HOST_DEVICE static double magnitude(Bits b) {
    const std::uint32_t exponent = (b >> 10) & 0x1fu;
    const std::uint32_t mantissa = b & 0x3ffu;
    const std::uint32_t implicit = exponent != 0 ? 1024u : 0u;
    const std::uint32_t e = exponent != 0 ? exponent : 1u;
    const std::uint64_t pow2 = static_cast<std::uint64_t>(e - 25 + 1023) << 52;
    return static_cast<double>(implicit + mantissa) * bits_to_f64(pow2);
  }
};

template <>
struct Element<GradDtype::kBFloat16> {
  using Bits = std::uint16_t;
  SG_HOST_DEVICE static bool nonfinite(Bits b) { return (b & 0x7f80u) == 0x7f80u; }
  SG_HOST_DEVICE static bool nan(Bits b) { return nonfinite(b) && (b & 0x007fu) != 0; }
  SG_HOST_DEVICE static double magnitude(Bits b) {
    return static_cast<double>(bits_to_f32((static_cast<std::uint32_t>(b) & 0x7fffu) << 16));
  }
};

/// The square (of element * inv_scale) that one element adds to its lane: 0 when non-finite.
template <GradDtype DT>
SG_HOST_DEVICE double element_square(typename Element<DT>::Bits b, double inv_scale) {
  const double v = Element<DT>::nonfinite(b) ? 0.0 : Element<DT>::magnitude(b) * inv_scale;
  return v * v;
}

/// One chunk on the CPU, in the GPU block's order: `n` elements starting at `p` (the chunk's
/// first element, at a multiple of lanes_per_row within its tensor).
template <GradDtype DT>
inline ChunkStats inspect_chunk(const typename Element<DT>::Bits* p, std::int64_t n,
                                double inv_scale) {
  using E = Element<DT>;
  constexpr int kSlots = kPacketBytes / sizeof(typename E::Bits);
  constexpr int kLanes = kThreadsPerChunk * kSlots;
  alignas(64) double lanes[kLanes];
  for (int k = 0; k < kLanes; ++k) lanes[k] = 0.0;
  std::int64_t nan_count = 0;
  std::int64_t nonfinite_count = 0;
  for (std::int64_t base = 0; base < n; base += kLanes) {
    const int m = n - base < kLanes ? static_cast<int>(n - base) : kLanes;
    const typename E::Bits* row = p + base;
    for (int k = 0; k < m; ++k) {
      const typename E::Bits b = row[k];
      lanes[k] += element_square<DT>(b, inv_scale);
      nonfinite_count += E::nonfinite(b) ? 1 : 0;
      nan_count += E::nan(b) ? 1 : 0;
    }
  }
  alignas(64) double per_thread[kThreadsPerChunk];
  for (int t = 0; t < kThreadsPerChunk; ++t)
    per_thread[t] = combine_slots(lanes + t * kSlots, kSlots);
  ChunkStats out;
  out.sum_squares = tree_sum_threads(per_thread);
  out.nan_count = nan_count;
  out.inf_count = nonfinite_count - nan_count;
  return out;
}

}  // namespace inspect
}  // namespace stepguard
