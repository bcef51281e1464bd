/*
 * Per-element gradient inspection and the per-chunk reduction order, shared by the CPU pass
 * (cpu_chunk.h) and the CUDA kernel so that the CPU tests exercise the very code the GPU runs.
 * Torch-free: plain bits and pointers.
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

/// Element traits: the raw bit type, the sign-free bits of +Inf, and the magnitude of a finite
/// element (given its sign-free bits) as double. With the sign cleared, a value is non-finite when
/// its bits are >= those of +Inf and NaN when they are greater: exponent-bit tests that fast-math
/// cannot fold away, written without branches so the CPU loop vectorizes.
template <GradDtype DT>
struct Element;

template <>
struct Element<GradDtype::kFloat32> {
  using Bits = std::uint32_t;
  static constexpr Bits kMagnitudeMask = 0x7fffffffu;
  static constexpr Bits kInfBits = 0x7f800000u;
  SG_HOST_DEVICE static double magnitude(Bits m) { return static_cast<double>(bits_to_f32(m)); }
};

template <>
struct Element<GradDtype::kFloat64> {
  using Bits = std::uint64_t;
  static constexpr Bits kMagnitudeMask = 0x7fffffffffffffffull;
  static constexpr Bits kInfBits = 0x7ff0000000000000ull;
  SG_HOST_DEVICE static double magnitude(Bits m) { return bits_to_f64(m); }
};

template <>
struct Element<GradDtype::kFloat16> {
  using Bits = std::uint16_t;
  static constexpr Bits kMagnitudeMask = 0x7fffu;
  static constexpr Bits kInfBits = 0x7c00u;
  // Exact: (implicit + mantissa) * 2^(max(exponent, 1) - 25), the power of two built from bits.
  // Subnormals (exponent 0) have no implicit bit and exponent 1.
  SG_HOST_DEVICE static double magnitude(Bits m) {
    const std::uint32_t exponent = static_cast<std::uint32_t>(m) >> 10;
    const std::uint32_t mantissa = static_cast<std::uint32_t>(m) & 0x3ffu;
    // Arithmetic rather than selects, so the compiler keeps the loop branch-free.
    const std::uint32_t is_normal = exponent != 0;
    const std::uint32_t implicit = is_normal << 10;
    const std::uint64_t e = exponent + (1u - is_normal);
    const std::uint64_t pow2 = (e + (1023 - 25)) << 52;
    return static_cast<double>(static_cast<std::int32_t>(implicit + mantissa)) * bits_to_f64(pow2);
  }
};

template <>
struct Element<GradDtype::kBFloat16> {
  using Bits = std::uint16_t;
  static constexpr Bits kMagnitudeMask = 0x7fffu;
  static constexpr Bits kInfBits = 0x7f80u;
  SG_HOST_DEVICE static double magnitude(Bits m) {
    return static_cast<double>(bits_to_f32(static_cast<std::uint32_t>(m) << 16));
  }
};

/// What one element contributes to its lane and to the counts.
struct ElementContribution {
  double square;  ///< (element * inv_scale)^2, 0 when non-finite
  int nonfinite;  ///< 1 for NaN or +/-Inf
  int nan;        ///< 1 for NaN
};

template <GradDtype DT>
SG_HOST_DEVICE ElementContribution contribution(typename Element<DT>::Bits b, double inv_scale) {
  using E = Element<DT>;
  using Bits = typename E::Bits;
  const Bits m = b & E::kMagnitudeMask;
  // A mask instead of a select: with a select the compiler branches around the FP math.
  const Bits finite = m < E::kInfBits;
  const Bits finite_bits = m & static_cast<Bits>(Bits{0} - finite);
  const double v = E::magnitude(finite_bits) * inv_scale;
  return {v * v, static_cast<int>(1 - finite), m > E::kInfBits ? 1 : 0};
}

/// True when the element is NaN or +/-Inf.
template <GradDtype DT>
SG_HOST_DEVICE bool is_nonfinite(typename Element<DT>::Bits b) {
  return (b & Element<DT>::kMagnitudeMask) >= Element<DT>::kInfBits;
}

/// 1 when the element is finite and below zero (-0.0 is not): in a tensor that must hold no
/// negative value (an optimizer's second moment, whose square root the update takes), such an
/// element counts with the NaNs (InspectOptions::nonnegative).
template <GradDtype DT>
SG_HOST_DEVICE int negative_finite(typename Element<DT>::Bits b) {
  using E = Element<DT>;
  const typename E::Bits m = b & E::kMagnitudeMask;
  return (b != m && m != 0 && m < E::kInfBits) ? 1 : 0;
}

}  // namespace inspect
}  // namespace stepguard
