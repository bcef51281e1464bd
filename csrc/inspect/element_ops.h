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

/// Elements per chunk: the unit of parallel work and of the fixed reduction order.
constexpr std::int64_t kChunkElements = std::int64_t{1} << 16;

/// Class of one element: finite, NaN or +/-Inf.
enum ElementClass : int { kFinite = 0, kNaN = 1, kInf = 2 };

SG_HOST_DEVICE int classify_f32(std::uint32_t bits) {
  if ((bits & 0x7f800000u) != 0x7f800000u) return kFinite;
  return (bits & 0x007fffffu) ? kNaN : kInf;
}
SG_HOST_DEVICE int classify_f16(std::uint16_t bits) {
  if ((bits & 0x7c00u) != 0x7c00u) return kFinite;
  return (bits & 0x03ffu) ? kNaN : kInf;
}
SG_HOST_DEVICE int classify_bf16(std::uint16_t bits) {
  if ((bits & 0x7f80u) != 0x7f80u) return kFinite;
  return (bits & 0x007fu) ? kNaN : kInf;
}
SG_HOST_DEVICE int classify_f64(std::uint64_t bits) {
  if ((bits & 0x7ff0000000000000ull) != 0x7ff0000000000000ull) return kFinite;
  return (bits & 0x000fffffffffffffull) ? kNaN : kInf;
}

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

/// IEEE binary16 of a finite value to double, exactly (subnormals included).
SG_HOST_DEVICE double f16_to_f64(std::uint16_t bits) {
  const int sign = (bits >> 15) & 1;
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  double magnitude;
  if (exponent == 0) {
    magnitude = static_cast<double>(mantissa) * (1.0 / 16777216.0);  // mantissa * 2^-24
  } else {
    // (1024 + mantissa) * 2^(exponent - 25), built from an exact power of two.
    const std::uint64_t pow_bits = static_cast<std::uint64_t>(exponent - 25 + 1023) << 52;
    magnitude = static_cast<double>(1024 + mantissa) * bits_to_f64(pow_bits);
  }
  return sign ? -magnitude : magnitude;
}

/// bfloat16 to double: the upper half of an fp32.
SG_HOST_DEVICE double bf16_to_f64(std::uint16_t bits) {
  return static_cast<double>(bits_to_f32(static_cast<std::uint32_t>(bits) << 16));
}

/// Partial results of one chunk. Chunks combine in index order only.
struct ChunkStats {
  double sum_squares = 0.0;
  std::int64_t nan_count = 0;
  std::int64_t inf_count = 0;
};

SG_HOST_DEVICE void add_element(ChunkStats& acc, int cls, double value, double inv_scale) {
  if (cls == kFinite) {
    const double v = value * inv_scale;
    acc.sum_squares += v * v;
  } else if (cls == kNaN) {
    ++acc.nan_count;
  } else {
    ++acc.inf_count;
  }
}

/// Inspects elements [begin, end) of one gradient given as raw bits. When `unscale` is set, each
/// finite element is multiplied by inv_scale in place (non-finite ones are left as they are).
SG_HOST_DEVICE ChunkStats inspect_range(void* data, GradDtype dtype, std::int64_t begin,
                                        std::int64_t end, double inv_scale, bool unscale) {
  ChunkStats acc;
  switch (dtype) {
    case GradDtype::kFloat32: {
      auto* p = static_cast<std::uint32_t*>(data);
      const float scale_f = static_cast<float>(inv_scale);
      for (std::int64_t i = begin; i < end; ++i) {
        const int cls = classify_f32(p[i]);
        const float f = bits_to_f32(p[i]);
        add_element(acc, cls, static_cast<double>(f), inv_scale);
        if (unscale && cls == kFinite) p[i] = f32_to_bits(f * scale_f);
      }
      break;
    }
    case GradDtype::kFloat64: {
      auto* p = static_cast<std::uint64_t*>(data);
      for (std::int64_t i = begin; i < end; ++i) {
        const int cls = classify_f64(p[i]);
        const double d = bits_to_f64(p[i]);
        add_element(acc, cls, d, inv_scale);
        if (unscale && cls == kFinite) {
          const double u = d * inv_scale;
          std::memcpy(&p[i], &u, sizeof u);
        }
      }
      break;
    }
    case GradDtype::kFloat16:
    case GradDtype::kBFloat16: {
      // Half types are inspected read-only here; in-place unscale of them is done by the caller
      // through a float round trip (see inspect_cpu.cpp), because rounding back to 16 bits needs
      // the platform's conversion.
      auto* p = static_cast<const std::uint16_t*>(data);
      const bool is_half = dtype == GradDtype::kFloat16;
      for (std::int64_t i = begin; i < end; ++i) {
        const int cls = is_half ? classify_f16(p[i]) : classify_bf16(p[i]);
        const double d = cls != kFinite ? 0.0 : (is_half ? f16_to_f64(p[i]) : bf16_to_f64(p[i]));
        add_element(acc, cls, d, inv_scale);
      }
      break;
    }
  }
  return acc;
}

}  // namespace inspect
}  // namespace stepguard
