#include "csrc/inspect/inspect.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "csrc/inspect/cpu_chunk.h"
#include "csrc/inspect/cuda/inspect_cuda.h"
#include "csrc/inspect/grad_views.h"

namespace stepguard {
namespace inspect {

GradDtype grad_dtype_of(const at::Tensor& grad, std::size_t index) {
  switch (grad.scalar_type()) {
    case at::kFloat:
      return GradDtype::kFloat32;
    case at::kHalf:
      return GradDtype::kFloat16;
    case at::kBFloat16:
      return GradDtype::kBFloat16;
    case at::kDouble:
      return GradDtype::kFloat64;
    default:
      TORCH_CHECK(false, "stepguard: gradient ", index, " has dtype ", grad.scalar_type(),
                  "; inspection supports float32, float16, bfloat16 and float64");
  }
  return GradDtype::kFloat32;  // unreachable
}

namespace {

using detail::GradViews;

// One unit of work: a fixed-size slice of one gradient, with its address resolved up front so the
// workers touch no at::Tensor (many small gradients: one chunk each, walked back to back).
struct Chunk {
  void* data;
  std::int64_t count;
  std::int32_t tensor;
  GradDtype dtype;
  bool nonnegative;  ///< a negative element counts as NaN (InspectOptions::nonnegative)
};

// The hot loops, compiled for AVX-512, AVX2 and the baseline; the loader picks one at start-up.
// Without -ffast-math the compiler keeps every lane's order, so each clone gives the same bits.
#if defined(__x86_64__) && defined(__GNUC__)
#define SG_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SG_CPU_CLONES
#endif

SG_CPU_CLONES ChunkStats chunk_f32(const void* p, std::int64_t n, double inv_scale,
                                   const void* next) {
  const auto* bits = static_cast<const std::uint32_t*>(p);
  return inv_scale == 1.0 ? inspect_chunk<GradDtype::kFloat32, false>(bits, n, inv_scale, next)
                          : inspect_chunk<GradDtype::kFloat32, true>(bits, n, inv_scale, next);
}
SG_CPU_CLONES ChunkStats chunk_f16(const void* p, std::int64_t n, double inv_scale,
                                   const void* next) {
  const auto* bits = static_cast<const std::uint16_t*>(p);
  return inv_scale == 1.0 ? inspect_chunk<GradDtype::kFloat16, false>(bits, n, inv_scale, next)
                          : inspect_chunk<GradDtype::kFloat16, true>(bits, n, inv_scale, next);
}
SG_CPU_CLONES ChunkStats chunk_bf16(const void* p, std::int64_t n, double inv_scale,
                                    const void* next) {
  const auto* bits = static_cast<const std::uint16_t*>(p);
  return inv_scale == 1.0 ? inspect_chunk<GradDtype::kBFloat16, false>(bits, n, inv_scale, next)
                          : inspect_chunk<GradDtype::kBFloat16, true>(bits, n, inv_scale, next);
}
SG_CPU_CLONES ChunkStats chunk_f64(const void* p, std::int64_t n, double inv_scale,
                                   const void* next) {
  const auto* bits = static_cast<const std::uint64_t*>(p);
  return inv_scale == 1.0 ? inspect_chunk<GradDtype::kFloat64, false>(bits, n, inv_scale, next)
                          : inspect_chunk<GradDtype::kFloat64, true>(bits, n, inv_scale, next);
}

// In-place unscale of finite elements while the chunk is hot. Each returns how many finite
// elements it turned into Inf (the product past the largest value of the gradient's dtype): they
// count as non-finite, so a step never applies a value the inspection did not see.
SG_CPU_CLONES std::int64_t unscale_f32(void* p, std::int64_t n, double inv_scale) {
  auto* x = static_cast<float*>(p);
  const float s = static_cast<float>(inv_scale);  // in fp32, as GradScaler does
  std::int64_t made = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const bool finite = (f32_to_bits(x[i]) & 0x7f800000u) != 0x7f800000u;
    const float y = finite ? x[i] * s : x[i];
    made += finite && (f32_to_bits(y) & 0x7f800000u) == 0x7f800000u;
    x[i] = y;
  }
  return made;
}
SG_CPU_CLONES std::int64_t unscale_f64(void* p, std::int64_t n, double inv_scale) {
  auto* x = static_cast<double*>(p);
  std::int64_t made = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const bool finite = std::isfinite(x[i]);
    const double y = finite ? x[i] * inv_scale : x[i];
    made += finite && !std::isfinite(y);
    x[i] = y;
  }
  return made;
}

// 16-bit types: computed in fp32 and rounded to nearest even, as ATen's mul_ does.
template <typename T, GradDtype DT>
std::int64_t unscale_16(void* p, std::int64_t n, double inv_scale) {
  auto* x = static_cast<T*>(p);
  const auto* bits = static_cast<const std::uint16_t*>(p);
  const float s = static_cast<float>(inv_scale);
  std::int64_t made = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    if (is_nonfinite<DT>(bits[i])) continue;
    const T y = static_cast<T>(static_cast<float>(x[i]) * s);
    made += is_nonfinite<DT>(y.x);  // the raw bits of the rounded value
    x[i] = y;
  }
  return made;
}

template <GradDtype DT>
std::int64_t count_negative(const void* p, std::int64_t n) {
  const auto* bits = static_cast<const typename Element<DT>::Bits*>(p);
  std::int64_t negative = 0;
  for (std::int64_t i = 0; i < n; ++i) negative += negative_finite<DT>(bits[i]);
  return negative;
}

// Finite elements below zero in one chunk, looked at while it is in cache.
SG_CPU_CLONES std::int64_t negative_in_chunk(GradDtype dtype, const void* p, std::int64_t n) {
  switch (dtype) {
    case GradDtype::kFloat32:
      return count_negative<GradDtype::kFloat32>(p, n);
    case GradDtype::kFloat64:
      return count_negative<GradDtype::kFloat64>(p, n);
    case GradDtype::kFloat16:
      return count_negative<GradDtype::kFloat16>(p, n);
    case GradDtype::kBFloat16:
      return count_negative<GradDtype::kBFloat16>(p, n);
  }
  return 0;
}

std::int64_t unscale_chunk(GradDtype dtype, void* p, std::int64_t n, double inv_scale) {
  switch (dtype) {
    case GradDtype::kFloat32:
      return unscale_f32(p, n, inv_scale);
    case GradDtype::kFloat64:
      return unscale_f64(p, n, inv_scale);
    case GradDtype::kFloat16:
      return unscale_16<c10::Half, GradDtype::kFloat16>(p, n, inv_scale);
    case GradDtype::kBFloat16:
      return unscale_16<c10::BFloat16, GradDtype::kBFloat16>(p, n, inv_scale);
  }
  return 0;
}

// `next`: the chunk the caller reads after this one, prefetched at the end (or null).
ChunkStats inspect_one_chunk(GradDtype dtype, const void* p, std::int64_t n, double inv_scale,
                             const void* next) {
  switch (dtype) {
    case GradDtype::kFloat32:
      return chunk_f32(p, n, inv_scale, next);
    case GradDtype::kFloat16:
      return chunk_f16(p, n, inv_scale, next);
    case GradDtype::kBFloat16:
      return chunk_bf16(p, n, inv_scale, next);
    case GradDtype::kFloat64:
      return chunk_f64(p, n, inv_scale, next);
  }
  return {};
}

// Checks every gradient before anything is touched, so a bad list changes no gradient; fills the
// contiguous views and dtypes. Returns the first defined gradient, or nullptr.
const at::Tensor* validate(const std::vector<at::Tensor>& grads, const at::Tensor& head,
                           GradViews* views) {
  TORCH_CHECK(head.defined() && head.dim() == 1 && head.numel() == inspect_slot::kCount &&
                  head.scalar_type() == at::kDouble,
              "stepguard: inspection results need a float64 tensor of 4 elements");
  const at::Tensor* first = nullptr;
  std::size_t first_index = 0;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (!g.defined()) continue;
    TORCH_CHECK(g.layout() == at::kStrided, "stepguard: gradient ", i,
                " is sparse; inspection supports dense gradients only");
    if (first == nullptr) {
      first = &g;
      first_index = i;
    } else {
      TORCH_CHECK(g.device() == first->device(), "stepguard: gradient ", i, " is on ", g.device(),
                  " but gradient ", first_index, " is on ", first->device(),
                  "; all gradients of one guard must be on one device");
    }
    TORCH_CHECK(g.device().is_cpu() || (g.device().is_cuda() && cuda::compiled_with_cuda()),
                "stepguard: gradient ", i, " is on ", g.device(), "; this build inspects ",
                cuda::compiled_with_cuda() ? "CPU and CUDA" : "CPU", " gradients only");
    views->set(i, grad_dtype_of(g, i));
  }
  if (first != nullptr) {
    TORCH_CHECK(head.device() == first->device(), "stepguard: inspection results are on ",
                head.device(), " but the gradients are on ", first->device());
  }
  return first;
}

// The CPU path: chunks in parallel, combined in a fixed order, results into `head`.
void inspect_on_cpu(const GradViews& views, const InspectOptions& options, const at::Tensor& head,
                    LocalStats* out) {
  LocalStats& stats = *out;
  std::vector<Chunk> chunks;
  chunks.reserve(views.size());
  for (std::size_t i = 0; i < views.size(); ++i) {
    if (!views[i].defined()) continue;
    const std::int64_t n = views[i].numel();
    if (n == 0) continue;
    stats.num_elements += n;
    char* base = static_cast<char*>(views[i].data_ptr());
    const GradDtype dt = views.dtype(i);
    const bool nonnegative = i < options.nonnegative.size() && options.nonnegative[i] != 0;
    for (std::int64_t b = 0; b < n; b += kChunkElements) {
      chunks.push_back({base + b * element_bytes(dt), std::min(kChunkElements, n - b),
                        static_cast<std::int32_t>(i), dt, nonnegative});
    }
  }

  const bool unscale_here = options.unscale_in_place && options.inv_scale != 1.0;
  std::vector<ChunkStats> partial(chunks.size());
  // A few chunks per task: enough to spread over threads, few enough to keep tasks cheap.
  at::parallel_for(
      0, static_cast<std::int64_t>(chunks.size()), 4, [&](std::int64_t lo, std::int64_t hi) {
        for (std::int64_t c = lo; c < hi; ++c) {
          const Chunk& ch = chunks[c];
          const void* next = c + 1 < hi ? chunks[c + 1].data : nullptr;
          partial[c] = inspect_one_chunk(ch.dtype, ch.data, ch.count, options.inv_scale, next);
          if (ch.nonnegative) {
            partial[c].nan_count += negative_in_chunk(ch.dtype, ch.data, ch.count);
          }
          // In the same visit, while the chunk is in cache.
          if (unscale_here) {
            partial[c].inf_count += unscale_chunk(ch.dtype, ch.data, ch.count, options.inv_scale);
          }
        }
      });

  // Fixed order: chunks within a tensor, then tensors in parameter order.
  std::vector<std::int64_t> tensor_nonfinite(views.size(), 0);
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    const ChunkStats& p = partial[c];
    stats.tensor_sum_squares[chunks[c].tensor] += p.sum_squares;
    tensor_nonfinite[chunks[c].tensor] += p.nan_count + p.inf_count;
    stats.nan_count += p.nan_count;
    stats.inf_count += p.inf_count;
  }
  for (std::size_t i = 0; i < views.size(); ++i) {
    stats.sum_squares += stats.tensor_sum_squares[i];
    if (tensor_nonfinite[i] > 0) stats.nonfinite_tensors.push_back(static_cast<std::int64_t>(i));
  }
  stats.sum_squares_overflow = !std::isfinite(stats.sum_squares);

  if (unscale_here) views.copy_back();
  double block[inspect_slot::kCount] = {};
  block[inspect_slot::kNanCount] = static_cast<double>(stats.nan_count);
  block[inspect_slot::kInfCount] = static_cast<double>(stats.inf_count);
  block[inspect_slot::kSumSquares] = stats.sum_squares_overflow ? 0.0 : stats.sum_squares;
  block[inspect_slot::kSumSquaresOverflow] = stats.sum_squares_overflow ? 1.0 : 0.0;
  head.copy_(at::tensor(at::ArrayRef<double>(block, inspect_slot::kCount),
                        at::TensorOptions().dtype(at::kDouble)));
}

}  // namespace

void inspect_into(const std::vector<at::Tensor>& grads, const InspectOptions& options,
                  const at::Tensor& head, LocalStats* out, DeferredBlame* blame) {
  TORCH_CHECK(std::isfinite(options.inv_scale) && options.inv_scale > 0.0,
              "stepguard: inv_scale must be finite and positive, got ", options.inv_scale);
  TORCH_CHECK(options.nonnegative.empty() || options.nonnegative.size() == grads.size(),
              "stepguard: ", options.nonnegative.size(), " nonnegative flags for ", grads.size(),
              " tensors");
  GradViews views(grads);
  const at::Tensor* first = validate(grads, head, &views);
  *out = LocalStats();
  *blame = DeferredBlame();
  out->num_tensors = static_cast<std::int64_t>(grads.size());
  out->tensor_sum_squares.assign(grads.size(), 0.0);
  if (first != nullptr && first->is_cuda()) {
    detail::inspect_on_cuda(views, options, head, out, blame);
    return;
  }
  inspect_on_cpu(views, options, head, out);
}

void check_gradients(const std::vector<at::Tensor>& grads, const at::Tensor& head) {
  GradViews views(grads);
  (void)validate(grads, head, &views);
}

void DeferredBlame::fetch(LocalStats* stats) const {
  if (!pending()) return;
  const at::Tensor sums = tensor_sum_squares.cpu();
  const at::Tensor flags = tensor_nonfinite.cpu();
  const std::size_t n = static_cast<std::size_t>(stats->num_tensors);
  stats->tensor_sum_squares.assign(sums.data_ptr<double>(), sums.data_ptr<double>() + n);
  stats->nonfinite_tensors.clear();
  for (std::size_t i = 0; i < n; ++i) {
    if (flags.data_ptr<int>()[i] != 0)
      stats->nonfinite_tensors.push_back(static_cast<std::int64_t>(i));
  }
}

LocalStats inspect_gradients(const std::vector<at::Tensor>& grads, const InspectOptions& options) {
  at::Device device = at::kCPU;
  for (const auto& g : grads) {
    if (g.defined()) {
      device = g.device();
      break;
    }
  }
  // Meta tensors have no data: let inspect_into refuse them with its own message.
  if (!device.is_cpu() && !device.is_cuda()) device = at::kCPU;
  const at::Tensor head =
      at::zeros({inspect_slot::kCount}, at::TensorOptions().dtype(at::kDouble).device(device));
  LocalStats stats;
  DeferredBlame blame;
  inspect_into(grads, options, head, &stats, &blame);
  if (blame.pending()) {
    const at::Tensor h = head.cpu();
    const double* g = h.data_ptr<double>();
    stats.nan_count = static_cast<std::int64_t>(g[inspect_slot::kNanCount]);
    stats.inf_count = static_cast<std::int64_t>(g[inspect_slot::kInfCount]);
    stats.sum_squares_overflow = g[inspect_slot::kSumSquaresOverflow] != 0.0;
    stats.sum_squares = stats.sum_squares_overflow ? std::numeric_limits<double>::infinity()
                                                   : g[inspect_slot::kSumSquares];
    blame.fetch(&stats);
  }
  return stats;
}

}  // namespace inspect
}  // namespace stepguard
