// The CPU pass gives the same bits on every instruction set it is compiled for: the chunk kernel
// built for AVX-512, AVX2 with FMA, AVX2 and the baseline, on fp64 data with a non-power-of-two
// unscale factor (where a fused multiply-add would round differently), compared bitwise.
// The library and this test are compiled with -ffp-contract=off; without it GCC fuses
// acc += v * v in the FMA-capable builds and the results differ in the last bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "csrc/inspect/element_ops.h"

namespace stepguard {
namespace inspect {
namespace {

#if defined(__x86_64__) && defined(__GNUC__)
using Kernel = ChunkStats (*)(const std::uint64_t*, std::int64_t, double);

__attribute__((target("avx512f"))) ChunkStats f64_avx512(const std::uint64_t* p, std::int64_t n,
                                                         double s) {
  return inspect_chunk<GradDtype::kFloat64, true>(p, n, s);
}
__attribute__((target("avx2,fma"))) ChunkStats f64_avx2_fma(const std::uint64_t* p, std::int64_t n,
                                                            double s) {
  return inspect_chunk<GradDtype::kFloat64, true>(p, n, s);
}
__attribute__((target("avx2"))) ChunkStats f64_avx2(const std::uint64_t* p, std::int64_t n,
                                                    double s) {
  return inspect_chunk<GradDtype::kFloat64, true>(p, n, s);
}
ChunkStats f64_baseline(const std::uint64_t* p, std::int64_t n, double s) {
  return inspect_chunk<GradDtype::kFloat64, true>(p, n, s);
}

std::uint64_t bits(double v) {
  std::uint64_t b = 0;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

TEST(InspectClones, EveryInstructionSetGivesTheSameBitsOnFp64WithANonPowerOfTwoScale) {
  struct Variant {
    const char* name;
    Kernel kernel;
    bool supported;
  };
  __builtin_cpu_init();
  const Variant variants[] = {
      {"avx512f", f64_avx512, __builtin_cpu_supports("avx512f") != 0},
      {"avx2+fma", f64_avx2_fma,
       __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("fma") != 0},
      {"avx2", f64_avx2, __builtin_cpu_supports("avx2") != 0},
  };
  int compared = 0;
  std::mt19937_64 rng(20261130);
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-40, 40);
  const double inv_scale = 1.0 / 3.7;  // not a power of two: every product rounds
  for (int t = 0; t < 50; ++t) {
    std::vector<double> data(4097);
    for (double& v : data) v = std::ldexp(mantissa(rng), exponent(rng));
    std::vector<std::uint64_t> raw(data.size());
    std::memcpy(raw.data(), data.data(), data.size() * sizeof(double));
    const auto n = static_cast<std::int64_t>(raw.size());
    const ChunkStats want = f64_baseline(raw.data(), n, inv_scale);
    for (const Variant& v : variants) {
      if (!v.supported) continue;
      const ChunkStats got = v.kernel(raw.data(), n, inv_scale);
      ASSERT_EQ(bits(got.sum_squares), bits(want.sum_squares)) << v.name << ", tensor " << t;
      ASSERT_EQ(got.nan_count, want.nan_count);
      ASSERT_EQ(got.inf_count, want.inf_count);
      ++compared;
    }
  }
  if (compared == 0) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512";
}
#endif

}  // namespace
}  // namespace inspect
}  // namespace stepguard
