// Inspection semantics on CPU. Expected values are computed here from the literal inputs, never
// through the code under test.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "csrc/inspect/inspect.h"

namespace stepguard {
namespace inspect {
namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

at::Tensor f32(std::vector<float> v) {
  return at::tensor(v, at::TensorOptions().dtype(at::kFloat));
}
// A 16-bit tensor with exact bit patterns, reinterpreted as `dtype` (kHalf or kBFloat16).
at::Tensor bits16(const std::vector<std::int16_t>& bits, at::ScalarType dtype) {
  return at::tensor(std::vector<std::int16_t>(bits), at::TensorOptions().dtype(at::kShort))
      .view(dtype);
}

TEST(Inspect, EmptyListIsAllZero) {
  const LocalStats s = inspect_gradients({});
  EXPECT_EQ(s.nan_count, 0);
  EXPECT_EQ(s.inf_count, 0);
  EXPECT_EQ(s.sum_squares, 0.0);
  EXPECT_EQ(s.num_tensors, 0);
  EXPECT_TRUE(s.nonfinite_tensors.empty());
}

TEST(Inspect, Float32SumOfSquaresIsExactForSmallIntegers) {
  const LocalStats s = inspect_gradients({f32({1, 2, 3, -4})});
  EXPECT_EQ(s.sum_squares, 30.0);
  EXPECT_EQ(s.nonfinite_count(), 0);
  EXPECT_EQ(s.num_elements, 4);
  EXPECT_FALSE(s.sum_squares_overflow);
}

TEST(Inspect, NanAndInfAtFirstLastAndTailAcrossChunks) {
  // Odd size spanning two chunks: the tail chunk holds 3 elements.
  const std::int64_t n = kChunkElements + 3;
  auto g = at::full({n}, 0.5f, at::kFloat);
  g[0] = kNaN;                   // first element
  g[kChunkElements - 1] = kInf;  // last of the first chunk
  g[n - 1] = -kInf;              // last element, in the tail
  const LocalStats s = inspect_gradients({f32({1.0f}), g});
  EXPECT_EQ(s.nan_count, 1);
  EXPECT_EQ(s.inf_count, 2);
  EXPECT_EQ(s.nonfinite_tensors, std::vector<std::int64_t>({1}));
  // 1 from the first tensor, 0.25 for each finite element of the second.
  EXPECT_EQ(s.sum_squares, 1.0 + 0.25 * static_cast<double>(n - 3));
  ASSERT_EQ(s.tensor_sum_squares.size(), 2u);
  EXPECT_EQ(s.tensor_sum_squares[0], 1.0);
}

TEST(Inspect, HugeFiniteValuesAreNotNonFinite) {
  const float big = std::numeric_limits<float>::max();
  const LocalStats s = inspect_gradients({f32({1e30f, big, -big})});
  EXPECT_EQ(s.nonfinite_count(), 0);
  const double b = static_cast<double>(big);
  const double e = static_cast<double>(1e30f);
  EXPECT_EQ(s.sum_squares, e * e + b * b + b * b);
  EXPECT_TRUE(std::isfinite(s.sum_squares));
  EXPECT_FALSE(s.sum_squares_overflow);
}

TEST(Inspect, OverflowOfTheSumOfSquaresIsReportedApartFromNonFinite) {
  // 1e200 is a finite fp64 gradient; its square is not.
  auto g = at::tensor(std::vector<double>{1e200, 1.0}, at::TensorOptions().dtype(at::kDouble));
  const LocalStats s = inspect_gradients({g});
  EXPECT_EQ(s.nonfinite_count(), 0);
  EXPECT_TRUE(s.sum_squares_overflow);
  EXPECT_TRUE(std::isinf(s.sum_squares));
}

TEST(Inspect, Float16BitPatterns) {
  // 0x3c00 = 1.0, 0xc000 = -2.0, 0x7bff = 65504 (max), 0x0001 = 2^-24 (smallest subnormal),
  // 0x7c00 = +Inf, 0xfc00 = -Inf, 0x7e00 = NaN, 0xfe01 = NaN with sign and payload.
  const auto g =
      bits16({0x3c00, static_cast<std::int16_t>(0xc000), 0x7bff, 0x0001, 0x7c00,
              static_cast<std::int16_t>(0xfc00), 0x7e00, static_cast<std::int16_t>(0xfe01)},
             at::kHalf);
  const LocalStats s = inspect_gradients({g});
  EXPECT_EQ(s.nan_count, 2);
  EXPECT_EQ(s.inf_count, 2);
  const double tiny = std::ldexp(1.0, -24);
  EXPECT_EQ(s.sum_squares, 1.0 + 4.0 + 65504.0 * 65504.0 + tiny * tiny);
}

TEST(Inspect, BFloat16BitPatterns) {
  // 0x3f80 = 1.0, 0x4040 = 3.0, 0x7f7f = max bf16, 0x0001 = smallest subnormal (2^-133),
  // 0x7f80 = +Inf, 0xff80 = -Inf, 0x7fc0 = NaN.
  const auto g =
      bits16({0x3f80, 0x4040, 0x7f7f, 0x0001, 0x7f80, static_cast<std::int16_t>(0xff80), 0x7fc0},
             at::kBFloat16);
  const LocalStats s = inspect_gradients({g});
  EXPECT_EQ(s.nan_count, 1);
  EXPECT_EQ(s.inf_count, 2);
  const double max_bf16 = std::ldexp(255.0, 120);  // 0x7f7f = (1 + 127/128) * 2^127
  const double tiny = std::ldexp(1.0, -133);
  EXPECT_EQ(s.sum_squares, 1.0 + 9.0 + max_bf16 * max_bf16 + tiny * tiny);
}

TEST(Inspect, Float64AndDenormals) {
  const double denorm = std::numeric_limits<double>::denorm_min();
  auto g =
      at::tensor(std::vector<double>{3.0, denorm, kNaN}, at::TensorOptions().dtype(at::kDouble));
  const LocalStats s = inspect_gradients({g});
  EXPECT_EQ(s.nan_count, 1);
  EXPECT_EQ(s.sum_squares, 9.0);  // denorm^2 underflows to 0 in fp64
  const float fdenorm = std::numeric_limits<float>::denorm_min();
  const LocalStats t = inspect_gradients({f32({fdenorm})});
  EXPECT_EQ(t.nonfinite_count(), 0);
  EXPECT_EQ(t.sum_squares, static_cast<double>(fdenorm) * static_cast<double>(fdenorm));
}

TEST(Inspect, MixedDtypesUndefinedEmptyAndSingleElement) {
  std::vector<at::Tensor> grads = {
      f32({2.0f}),                                                 // 0: 4
      at::Tensor(),                                                // 1: no gradient
      at::empty({0}, at::kFloat),                                  // 2: empty
      bits16({0x4000}, at::kHalf),                                 // 3: 2.0 -> 4
      bits16({0x7fc0}, at::kBFloat16),                             // 4: NaN
      at::full({5}, 1.0, at::TensorOptions().dtype(at::kDouble)),  // 5: 5
  };
  const LocalStats s = inspect_gradients(grads);
  EXPECT_EQ(s.num_tensors, 6);
  EXPECT_EQ(s.num_elements, 1 + 0 + 1 + 1 + 5);
  EXPECT_EQ(s.nan_count, 1);
  EXPECT_EQ(s.nonfinite_tensors, std::vector<std::int64_t>({4}));
  EXPECT_EQ(s.sum_squares, 13.0);
  EXPECT_EQ(s.tensor_sum_squares, std::vector<double>({4.0, 0.0, 0.0, 4.0, 0.0, 5.0}));
}

TEST(Inspect, NonContiguousGradientIsInspectedThroughACopy) {
  auto base = at::arange(12, at::kFloat).view({3, 4});
  auto t = base.t();  // non-contiguous view
  ASSERT_FALSE(t.is_contiguous());
  const LocalStats s = inspect_gradients({t});
  double expected = 0;
  for (int i = 0; i < 12; ++i) expected += static_cast<double>(i) * i;
  EXPECT_EQ(s.sum_squares, expected);
}

TEST(Inspect, InvScaleScalesTheSumOfSquares) {
  InspectOptions opt;
  opt.inv_scale = 0.5;
  const LocalStats s = inspect_gradients({f32({2, 4})}, opt);
  EXPECT_EQ(s.sum_squares, 1.0 + 4.0);
}

TEST(Inspect, UnscaleInPlaceTouchesFiniteElementsOnly) {
  auto g32 = f32({2, 4, static_cast<float>(kNaN)});
  auto gbf = bits16({0x4080 /* 4.0 */}, at::kBFloat16);
  auto nc = at::full({2, 2}, 8.0f, at::kFloat).t();
  InspectOptions opt;
  opt.inv_scale = 0.25;
  opt.unscale_in_place = true;
  inspect_gradients({g32, gbf, nc}, opt);
  EXPECT_EQ(g32[0].item<float>(), 0.5f);
  EXPECT_EQ(g32[1].item<float>(), 1.0f);
  EXPECT_TRUE(std::isnan(g32[2].item<float>()));
  EXPECT_EQ(gbf.to(at::kFloat).item<float>(), 1.0f);
  EXPECT_TRUE(at::all(nc == 2.0f).item<bool>());
}

// The check and the act see the same numbers: a finite element whose unscaled value is past the
// largest of its dtype is written as Inf, and it is counted as one (before, the fp64 check called
// it finite and the step was applied with an Inf gradient: NaN weights).
TEST(Inspect, AnElementTheUnscaleTurnsInfiniteCountsAsNonfinite) {
  auto g32 = f32({1e30f, 2.0f, 3.0f});
  auto g16 = bits16({0x7bff /* 65504, fp16 largest */, 0x0001 /* 2^-24 */}, at::kHalf);
  auto gbf = bits16({0x7f7f /* bf16's largest */}, at::kBFloat16);
  InspectOptions opt;
  opt.inv_scale = 1e10;  // a scale of 1e-10
  opt.unscale_in_place = true;
  const LocalStats s = inspect_gradients({g32, g16, gbf}, opt);
  EXPECT_EQ(s.inf_count, 3);
  EXPECT_EQ(s.nan_count, 0);
  EXPECT_EQ(s.nonfinite_tensors, (std::vector<std::int64_t>{0, 1, 2}));
  EXPECT_TRUE(std::isinf(g32[0].item<float>()));
  EXPECT_EQ(g32[1].item<float>(), 2e10f);
  EXPECT_TRUE(std::isinf(g16[0].item<float>()));
  EXPECT_TRUE(std::isinf(gbf[0].item<float>()));
  // A product that stays finite is not counted.
  auto ok = f32({1e28f});
  opt.inv_scale = 1e10;
  const LocalStats fine = inspect_gradients({ok}, opt);
  EXPECT_EQ(fine.inf_count, 0);
  EXPECT_EQ(ok.item<float>(), 1e28f * 1e10f);
}

TEST(Inspect, SixteenBitUnscaleRoundsLikeATen) {
  at::manual_seed(3);
  for (auto dtype : {at::kHalf, at::kBFloat16}) {
    auto g = (at::randn({10007}) * 1000).to(dtype);
    g[17] = std::nanf("");
    // The reference: ATen computes 16-bit products in fp32 and rounds to nearest even.
    const auto expected = (g.to(at::kFloat) * static_cast<float>(1.0 / 3.0)).to(dtype);
    InspectOptions opt;
    opt.inv_scale = 1.0 / 3.0;
    opt.unscale_in_place = true;
    inspect_gradients({g}, opt);
    EXPECT_TRUE(at::equal(g.narrow(0, 0, 17), expected.narrow(0, 0, 17))) << dtype;
    EXPECT_TRUE(at::equal(g.narrow(0, 18, 10007 - 18), expected.narrow(0, 18, 10007 - 18)))
        << dtype;
    EXPECT_TRUE(std::isnan(g[17].item<float>()));
  }
}

// The optimizer state check's second moments: a finite element below zero counts as NaN in a
// flagged tensor only; -0.0 is not below zero; NaN/Inf keep their own counts, once.
TEST(Inspect, ANegativeElementOfANonnegativeTensorCountsAsNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  InspectOptions flagged;
  flagged.nonnegative = {0, 1, 1, 1, 1};
  // fp16 -1.0 = 0xbc00, -0.0 = 0x8000, -NaN = 0xfe00; bf16 -2.0 = 0xc000, -Inf = 0xff80.
  const std::vector<at::Tensor> state = {
      f32({-1.0f, 2.0f}),                    // not flagged: -1 is fine
      f32({0.5f, -0.0f, -3.0f, nan, -nan}),  // one negative, two NaN
      bits16({0x3c00, static_cast<std::int16_t>(0xbc00), static_cast<std::int16_t>(0x8000),
              static_cast<std::int16_t>(0xfe00)},
             at::kHalf),  // one negative, one NaN
      bits16({0x4000, static_cast<std::int16_t>(0xc000), static_cast<std::int16_t>(0xff80)},
             at::kBFloat16),                                                // one negative, one Inf
      at::tensor(std::vector<double>{1e-300, -1e-300, 0.0}, at::kDouble)};  // one negative
  const LocalStats s = inspect_gradients(state, flagged);
  EXPECT_EQ(s.nan_count, 2 + 1 + 1 + 1 + 1 + 1);  // NaNs (3) and negatives (4)
  EXPECT_EQ(s.inf_count, 1);
  EXPECT_EQ(s.nonfinite_tensors, (std::vector<std::int64_t>{1, 2, 3, 4}));
  // Unflagged, the same tensors hold only their NaN/Inf.
  const LocalStats plain = inspect_gradients(state);
  EXPECT_EQ(plain.nan_count, 3);
  EXPECT_EQ(plain.inf_count, 1);
  EXPECT_EQ(plain.nonfinite_tensors, (std::vector<std::int64_t>{1, 2, 3}));
  // The sums of squares do not change with the flag.
  EXPECT_EQ(s.tensor_sum_squares, plain.tensor_sum_squares);
  // Across chunks: one negative in the last element of a tensor of three chunks.
  at::Tensor big = at::ones({3 * kChunkElements + 5}, at::kFloat);
  big[-1] = -1e-30f;
  InspectOptions one;
  one.nonnegative = {1};
  EXPECT_EQ(inspect_gradients({big}, one).nan_count, 1);
  EXPECT_EQ(inspect_gradients({big}).nan_count, 0);
  // A flag per tensor, or none.
  one.nonnegative = {1, 1};
  EXPECT_THROW(inspect_gradients({big}, one), c10::Error);
}

TEST(Inspect, RejectsUnsupportedDtypeNamingTheTensor) {
  auto good = f32({1.0f});
  auto bad = at::ones({3}, at::kInt);
  try {
    inspect_gradients({good, bad});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("gradient 1 has dtype Int"), std::string::npos)
        << e.what();
  }
}

TEST(Inspect, RejectsMixedDevicesBeforeChangingAnything) {
  auto cpu = f32({4.0f});
  auto meta = at::empty({3}, at::TensorOptions().dtype(at::kFloat).device(at::kMeta));
  InspectOptions opt;
  opt.inv_scale = 0.5;
  opt.unscale_in_place = true;
  try {
    inspect_gradients({cpu, meta}, opt);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("gradient 1 is on meta but gradient 0 is on cpu"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(cpu.item<float>(), 4.0f);  // nothing was unscaled
}

TEST(Inspect, RejectsBadInvScale) {
  InspectOptions opt;
  opt.inv_scale = 0.0;
  EXPECT_THROW(inspect_gradients({f32({1})}, opt), c10::Error);
  opt.inv_scale = kNaN;
  EXPECT_THROW(inspect_gradients({f32({1})}, opt), c10::Error);
}

TEST(Inspect, ManySmallTensorsKeepExactPerTensorResults) {
  // 3,000 small fp32/bf16/fp16 tensors walked back to back: each tensor's sum and flag is its own
  // (NaN in a bf16, -Inf in an fp32, +Inf in an fp16 tensor).
  // Constant small dyadic values, so every sum is exact in any order: n * c^2.
  std::vector<at::Tensor> grads;
  std::vector<double> expected;
  for (int i = 0; i < 3000; ++i) {
    const std::int64_t n = 1 + (i * 37) % 5000;
    const double c = 0.5 * (1 + i % 5);
    const at::ScalarType dtype = i % 3 == 0 ? at::kFloat : i % 3 == 1 ? at::kBFloat16 : at::kHalf;
    grads.push_back(at::full({n}, c, at::TensorOptions().dtype(dtype)));
    expected.push_back(static_cast<double>(n) * c * c);
  }
  grads[7][0] = kNaN;
  grads[1500][grads[1500].numel() - 1] = -kInf;
  grads[2999][3] = kInf;
  for (const int i : {7, 1500, 2999}) {
    const double c = 0.5 * (1 + i % 5);
    expected[i] -= c * c;  // the non-finite element adds nothing
  }
  const LocalStats s = inspect_gradients(grads);
  EXPECT_EQ(s.nan_count, 1);
  EXPECT_EQ(s.inf_count, 2);
  EXPECT_EQ(s.nonfinite_tensors, std::vector<std::int64_t>({7, 1500, 2999}));
  EXPECT_EQ(s.tensor_sum_squares, expected);
}

TEST(Inspect, MatchesAnIndependentReferenceAndIsDeterministicAcrossThreadCounts) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<at::Tensor> grads;
  double reference = 0.0;
  for (std::int64_t n : {std::int64_t{1}, std::int64_t{17}, std::int64_t{4096},
                         3 * kChunkElements + 5, std::int64_t{250000}}) {
    std::vector<float> v(n);
    for (auto& x : v) {
      x = dist(rng);
      reference += static_cast<double>(x) * static_cast<double>(x);
    }
    grads.push_back(f32(v));
  }
  const int saved = at::get_num_threads();
  at::set_num_threads(1);
  const LocalStats one = inspect_gradients(grads);
  at::set_num_threads(2);
  const LocalStats two = inspect_gradients(grads);
  at::set_num_threads(saved);
  EXPECT_EQ(one.sum_squares, two.sum_squares);  // bitwise
  EXPECT_EQ(one.tensor_sum_squares, two.tensor_sum_squares);
  EXPECT_NEAR(one.sum_squares, reference, 1e-12 * reference);
  EXPECT_EQ(one.nonfinite_count(), 0);
}

}  // namespace
}  // namespace inspect
}  // namespace stepguard
