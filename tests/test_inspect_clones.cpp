// The CPU chunk pass gives the same bits on every instruction set it is compiled for, and its fast
// pass (no per-element test, 16-bit elements read as words, lanes in planes, several rows per
// visit, short tree for small chunks) the same bits as the order the CUDA kernel follows.
//
// The reference below is written from the order's definition in element_ops.h (element k of a row
// to lane k, each GPU thread's slots pairwise, then the 256-way tree), with its own scalar decoding
// of each dtype; it shares no code with the pass under test but the two combine helpers that
// define the order. The library and this test are compiled with -ffp-contract=off; without it GCC
// fuses acc += v * v in the FMA-capable builds and the results differ in the last bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "csrc/inspect/cpu_chunk.h"

namespace stepguard {
namespace inspect {
namespace {

std::uint64_t bits(double v) {
  std::uint64_t b = 0;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// --- An independent reference of the specified order ---------------------------------------------

// The element as double, or NaN / +-Inf, decoded from its fields.
template <GradDtype DT>
double decode(typename Element<DT>::Bits b) {
  if constexpr (DT == GradDtype::kFloat32) {
    float f;
    std::memcpy(&f, &b, sizeof f);
    return static_cast<double>(f);
  } else if constexpr (DT == GradDtype::kFloat64) {
    double d;
    std::memcpy(&d, &b, sizeof d);
    return d;
  } else {
    const int mantissa_bits = DT == GradDtype::kFloat16 ? 10 : 7;
    const int exponent_max = DT == GradDtype::kFloat16 ? 31 : 255;
    const int bias = DT == GradDtype::kFloat16 ? 15 : 127;
    const double sign = (b & 0x8000u) ? -1.0 : 1.0;
    const int exponent = (b & 0x7fffu) >> mantissa_bits;
    const int mantissa = b & ((1 << mantissa_bits) - 1);
    if (exponent == exponent_max) {
      return mantissa != 0 ? std::numeric_limits<double>::quiet_NaN()
                           : sign * std::numeric_limits<double>::infinity();
    }
    if (exponent == 0) return sign * std::ldexp(mantissa, 1 - bias - mantissa_bits);
    return sign * std::ldexp(mantissa + (1 << mantissa_bits), exponent - bias - mantissa_bits);
  }
}

template <GradDtype DT>
ChunkStats reference_chunk(const typename Element<DT>::Bits* p, std::int64_t n, double inv_scale) {
  const int slots = elements_per_packet(DT);
  const int lanes_per_row_ = kThreadsPerChunk * slots;
  std::vector<double> lanes(lanes_per_row_, 0.0);
  ChunkStats out;
  for (std::int64_t k = 0; k < n; ++k) {
    const double x = decode<DT>(p[k]);
    if (std::isnan(x)) {
      ++out.nan_count;
    } else if (std::isinf(x)) {
      ++out.inf_count;
    } else {
      const double v = std::fabs(x) * inv_scale;
      lanes[k % lanes_per_row_] += v * v;
    }
  }
  std::vector<double> per_thread(kThreadsPerChunk);
  for (int t = 0; t < kThreadsPerChunk; ++t) {
    per_thread[t] = combine_slots(lanes.data() + t * slots, slots);
  }
  out.sum_squares = tree_sum_threads(per_thread.data());
  return out;
}

// --- Inputs
// ---------------------------------------------------------------------------------------

// Finite values of every magnitude the dtype holds (subnormals included), as raw bits.
template <GradDtype DT>
std::vector<typename Element<DT>::Bits> random_bits(std::int64_t n, std::mt19937_64& rng) {
  using Bits = typename Element<DT>::Bits;
  std::vector<Bits> out(static_cast<std::size_t>(n));
  std::uniform_int_distribution<std::uint64_t> any;
  for (Bits& b : out) {
    do {
      b = static_cast<Bits>(any(rng));
    } while (std::isnan(decode<DT>(b)) || std::isinf(decode<DT>(b)));
  }
  return out;
}

template <GradDtype DT>
typename Element<DT>::Bits special(int which) {
  using E = Element<DT>;
  using Bits = typename E::Bits;
  const Bits sign = static_cast<Bits>(~E::kMagnitudeMask);
  switch (which) {
    case 0:
      return E::kInfBits;  // +Inf
    case 1:
      return static_cast<Bits>(E::kInfBits | sign);  // -Inf
    default:
      return static_cast<Bits>(E::kInfBits | 1 | sign);  // NaN with sign and payload
  }
}

template <GradDtype DT, bool kScaled>
void expect_fast_equals_reference(const typename Element<DT>::Bits* p, std::int64_t n,
                                  double inv_scale, const char* what) {
  const ChunkStats want = reference_chunk<DT>(p, n, kScaled ? inv_scale : 1.0);
  const ChunkStats fast = inspect_chunk<DT, kScaled>(p, n, inv_scale);
  const ChunkStats masked = inspect_chunk_masked<DT, kScaled>(p, n, inv_scale);
  const struct {
    const char* pass;
    ChunkStats got;
  } passes[] = {{"fast", fast}, {"masked", masked}};
  for (const auto& [pass, got] : passes) {
    ASSERT_EQ(bits(got.sum_squares), bits(want.sum_squares))
        << pass << " pass, dtype " << static_cast<int>(DT) << ", n " << n << ", " << what;
    ASSERT_EQ(got.nan_count, want.nan_count) << pass << ", n " << n << ", " << what;
    ASSERT_EQ(got.inf_count, want.inf_count) << pass << ", n " << n << ", " << what;
  }
}

template <GradDtype DT>
void check_dtype(std::uint64_t seed) {
  using Bits = typename Element<DT>::Bits;
  std::mt19937_64 rng(seed);
  const std::int64_t row = lanes_per_row(DT);
  // Tiny, partial-row, whole-row, several-pass and odd sizes, up to a whole chunk.
  const std::int64_t sizes[] = {
      1,   2,       3,       7,       9,           63,          row / 2 + 1,        row - 1,
      row, row + 1, 3 * row, 4 * row, 5 * row + 3, 9 * row - 1, kChunkElements - 1, kChunkElements};
  const double inv_scale = 1.0 / 3.7;  // not a power of two: every product rounds
  for (const std::int64_t n : sizes) {
    // One element in front: 16-bit data then starts 2 bytes past a 4-byte boundary.
    std::vector<Bits> data = random_bits<DT>(n + 1, rng);
    const Bits* p = data.data() + 1;
    expect_fast_equals_reference<DT, false>(p, n, 1.0, "finite");
    expect_fast_equals_reference<DT, true>(p, n, inv_scale, "finite, scaled");
    // NaN, +Inf, -Inf at the first, last and a random element.
    std::uniform_int_distribution<std::int64_t> at(0, n - 1);
    for (int which = 0; which < 3; ++which) {
      for (const std::int64_t k : {std::int64_t{0}, n - 1, at(rng)}) {
        const Bits saved = data[k + 1];
        data[k + 1] = special<DT>(which);
        expect_fast_equals_reference<DT, false>(p, n, 1.0, "one non-finite");
        expect_fast_equals_reference<DT, true>(p, n, inv_scale, "one non-finite, scaled");
        data[k + 1] = saved;
      }
    }
  }
}

TEST(InspectChunk, FastPassMatchesTheSpecifiedOrderBitwiseForEveryDtype) {
  check_dtype<GradDtype::kFloat32>(1);
  check_dtype<GradDtype::kFloat16>(2);
  check_dtype<GradDtype::kBFloat16>(3);
  check_dtype<GradDtype::kFloat64>(4);
}

TEST(InspectChunk, AnOverflowingSumTakesTheMaskedPassWithTheSameBits) {
  // Finite elements whose squares overflow fp64: no NaN/Inf is counted, the sum is +Inf.
  std::vector<double> big(3000, 1e200);
  std::vector<std::uint64_t> raw(big.size());
  std::memcpy(raw.data(), big.data(), big.size() * sizeof(double));
  const ChunkStats s = inspect_chunk<GradDtype::kFloat64, false>(
      raw.data(), static_cast<std::int64_t>(raw.size()), 1.0);
  EXPECT_TRUE(std::isinf(s.sum_squares));
  EXPECT_EQ(s.nan_count + s.inf_count, 0);
  // fp32 maximum times a huge unscale factor: the scaled values overflow as well.
  const float fmax = std::numeric_limits<float>::max();
  std::uint32_t fbits;
  std::memcpy(&fbits, &fmax, sizeof fbits);
  std::vector<std::uint32_t> f(5000, fbits);
  expect_fast_equals_reference<GradDtype::kFloat32, true>(f.data(), 5000, 1e300, "overflow");
  const ChunkStats t = inspect_chunk<GradDtype::kFloat32, true>(f.data(), 5000, 1e300);
  EXPECT_TRUE(std::isinf(t.sum_squares));
  EXPECT_EQ(t.nan_count + t.inf_count, 0);
}

#if defined(__x86_64__) && defined(__GNUC__)
template <GradDtype DT>
using Kernel = ChunkStats (*)(const typename Element<DT>::Bits*, std::int64_t, double);

#define SG_VARIANTS(DT, NAME)                                                                 \
  __attribute__((target("avx512f")))                                                          \
  ChunkStats NAME##_avx512(const typename Element<DT>::Bits* p, std::int64_t n, double s) {   \
    return inspect_chunk<DT, true>(p, n, s);                                                  \
  }                                                                                           \
  __attribute__((target("avx2,fma")))                                                         \
  ChunkStats NAME##_avx2_fma(const typename Element<DT>::Bits* p, std::int64_t n, double s) { \
    return inspect_chunk<DT, true>(p, n, s);                                                  \
  }                                                                                           \
  __attribute__((target("avx2")))                                                             \
  ChunkStats NAME##_avx2(const typename Element<DT>::Bits* p, std::int64_t n, double s) {     \
    return inspect_chunk<DT, true>(p, n, s);                                                  \
  }                                                                                           \
  ChunkStats NAME##_baseline(const typename Element<DT>::Bits* p, std::int64_t n, double s) { \
    return inspect_chunk<DT, true>(p, n, s);                                                  \
  }

SG_VARIANTS(GradDtype::kFloat64, f64)
SG_VARIANTS(GradDtype::kFloat32, f32)
SG_VARIANTS(GradDtype::kBFloat16, bf16)
SG_VARIANTS(GradDtype::kFloat16, f16)
#undef SG_VARIANTS

template <GradDtype DT>
int compare_clones(Kernel<DT> avx512, Kernel<DT> avx2_fma, Kernel<DT> avx2, Kernel<DT> baseline,
                   std::uint64_t seed) {
  struct Variant {
    const char* name;
    Kernel<DT> kernel;
    bool supported;
  };
  __builtin_cpu_init();
  const Variant variants[] = {
      {"avx512f", avx512, __builtin_cpu_supports("avx512f") != 0},
      {"avx2+fma", avx2_fma,
       __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("fma") != 0},
      {"avx2", avx2, __builtin_cpu_supports("avx2") != 0},
  };
  int compared = 0;
  std::mt19937_64 rng(seed);
  const double inv_scale = 1.0 / 3.7;  // not a power of two: every product rounds
  for (int t = 0; t < 20; ++t) {
    const std::int64_t n = t % 2 == 0 ? 4097 : 5 * lanes_per_row(DT) + 3;
    const auto raw = random_bits<DT>(n, rng);
    const ChunkStats want = baseline(raw.data(), n, inv_scale);
    for (const Variant& v : variants) {
      if (!v.supported) continue;
      const ChunkStats got = v.kernel(raw.data(), n, inv_scale);
      EXPECT_EQ(bits(got.sum_squares), bits(want.sum_squares))
          << v.name << ", dtype " << static_cast<int>(DT) << ", tensor " << t;
      EXPECT_EQ(got.nan_count, want.nan_count);
      EXPECT_EQ(got.inf_count, want.inf_count);
      ++compared;
    }
  }
  return compared;
}

TEST(InspectClones, EveryInstructionSetGivesTheSameBitsWithANonPowerOfTwoScale) {
  int compared = 0;
  compared += compare_clones<GradDtype::kFloat64>(f64_avx512, f64_avx2_fma, f64_avx2, f64_baseline,
                                                  20261130);
  compared += compare_clones<GradDtype::kFloat32>(f32_avx512, f32_avx2_fma, f32_avx2, f32_baseline,
                                                  20261131);
  compared += compare_clones<GradDtype::kBFloat16>(bf16_avx512, bf16_avx2_fma, bf16_avx2,
                                                   bf16_baseline, 20261132);
  compared += compare_clones<GradDtype::kFloat16>(f16_avx512, f16_avx2_fma, f16_avx2, f16_baseline,
                                                  20261133);
  if (compared == 0) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512";
}
#endif

}  // namespace
}  // namespace inspect
}  // namespace stepguard
