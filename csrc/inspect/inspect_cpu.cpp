#include "csrc/inspect/inspect.h"

#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "csrc/inspect/cpu_chunk.h"
#include "csrc/inspect/cuda/inspect_cuda.h"

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

// One unit of work: a fixed-size slice of one gradient, with its address resolved up front so the
// workers touch no at::Tensor (many small gradients: one chunk each, walked back to back).
struct Chunk {
  void* data;
  std::int64_t count;
  std::int32_t tensor;
  GradDtype dtype;
};

// The gradients as the passes read them: a contiguous gradient itself, any other through a
// contiguous copy held here. No at::Tensor handle is copied per gradient (that is an atomic
// reference count up and down each, which adds up over many small gradients).
class GradViews {
 public:
  explicit GradViews(const std::vector<at::Tensor>& grads)
      : grads_(grads), copies_(grads.size()), dtypes_(grads.size(), GradDtype::kFloat32) {}
  std::size_t size() const { return grads_.size(); }
  const at::Tensor& operator[](std::size_t i) const {
    return copies_[i].defined() ? copies_[i] : grads_[i];
  }
  GradDtype dtype(std::size_t i) const { return dtypes_[i]; }
  void set(std::size_t i, GradDtype dtype) {
    dtypes_[i] = dtype;
    if (!grads_[i].is_contiguous()) copies_[i] = grads_[i].contiguous();
  }
  /// Writes unscaled copies back into their gradients.
  void copy_back() const {
    for (std::size_t i = 0; i < copies_.size(); ++i) {
      if (copies_[i].defined()) grads_[i].copy_(copies_[i]);
    }
  }

 private:
  const std::vector<at::Tensor>& grads_;
  std::vector<at::Tensor> copies_;  ///< defined for the non-contiguous gradients only
  std::vector<GradDtype> dtypes_;
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

// --- The CUDA path ------------------------------------------------------------------------------
//
// Everything goes through the device-generic c10 interface (libc10), never c10_cuda/torch_cuda, so
// this file builds and links against a CPU-only LibTorch as well; with a CUDA LibTorch the CUDA
// guard impl, stream pool and caching allocator are registered behind it.
//
// The launch runs on PyTorch's current CUDA stream of the gradients' device, the stream that
// produced the gradients and that will consume the results. Turning that c10::Stream into a
// cudaStream_t generically takes c10::Stream::native_handle(), which LibTorch has from 2.11 on
// (before, only c10::cuda::CUDAStream::stream(), in c10_cuda, can). Detected on the type rather
// than by TORCH_VERSION_MAJOR/MINOR, so the first LibTorch that has it uses it and an older one
// falls back (see inspect_on_cuda).
template <typename S, typename = void>
struct HasNativeHandle : std::false_type {};
template <typename S>
struct HasNativeHandle<S, std::void_t<decltype(std::declval<const S&>().native_handle())>>
    : std::true_type {};
constexpr bool kCurrentStreamLaunch = HasNativeHandle<c10::Stream>::value;

template <typename S>
void* native_handle_of(const S& stream) {
  if constexpr (HasNativeHandle<S>::value) {
    return stream.native_handle();
  } else {
    (void)stream;
    return nullptr;  // not called: the fallback launches on the legacy default stream
  }
}

// The inspector's table and scratch from PyTorch's caching allocator: no cudaMalloc, and no
// cudaFree (which would wait for the whole device) when a rebuild drops the old ones, which can
// be every step when the gradients are reallocated (zero_grad(set_to_none=True)). FusedInspector
// calls this with the launch stream as PyTorch's current stream, so the block belongs to that
// stream, and the caching allocator hands a freed block out again only to allocations on it: to
// work ordered after every kernel that read the old table. That is what makes dropping it while a
// launch is pending safe (cuda::DeviceAllocator).
cuda::DeviceAllocator caching_allocator(at::Device device) {
  return [device](std::size_t bytes) -> std::shared_ptr<void> {
    at::Tensor block = at::empty({static_cast<std::int64_t>(bytes)},
                                 at::TensorOptions().dtype(at::kByte).device(device));
    void* p = block.data_ptr();
    return std::shared_ptr<void>(p, [block](void*) mutable { block = at::Tensor(); });
  };
}

// One FusedInspector per device, stream and thread: its table, partials and done counter are
// used on that one stream only, so launches on different streams never share scratch and every
// buffer is covered by the caching allocator's stream-ordered reuse. A captured CUDA graph keeps
// using the table of its capture stream's inspector. At most kMaxInspectors per thread: the least
// recently used one is dropped (its buffers go back to the allocator as on a rebuild).
cuda::FusedInspector& inspector_for(at::Device device, void* stream) {
  struct Entry {
    int device;
    void* stream;
    std::uint64_t used;
    std::unique_ptr<cuda::FusedInspector> inspector;
  };
  constexpr std::size_t kMaxInspectors = 8;
  thread_local std::vector<Entry> cache;
  thread_local std::uint64_t calls = 0;
  ++calls;
  for (Entry& e : cache) {
    if (e.device == device.index() && e.stream == stream) {
      e.used = calls;
      return *e.inspector;
    }
  }
  auto made = std::make_unique<cuda::FusedInspector>(device.index(), caching_allocator(device));
  if (cache.size() >= kMaxInspectors) {
    cache.erase(std::min_element(cache.begin(), cache.end(),
                                 [](const Entry& a, const Entry& b) { return a.used < b.used; }));
  }
  cache.push_back({device.index(), stream, calls, std::move(made)});
  return *cache.back().inspector;
}

// One fused launch writing `head` in place, on the current stream; no host read, no host wait.
void inspect_on_cuda(const GradViews& views, const InspectOptions& options, const at::Tensor& head,
                     LocalStats* stats, DeferredBlame* blame) {
  const at::Device device = head.device();
  // The caller's current device comes back on every path out, through PyTorch's own device switch
  // (as its ops do); FusedInspector then finds the device current and switches nothing.
  const c10::DeviceGuard device_guard(device);
  const c10::impl::VirtualGuardImpl cuda_impl(c10::DeviceType::CUDA);
  const c10::Stream current = cuda_impl.getStream(device);

  std::vector<cuda::DeviceGradient> device_grads(views.size());
  for (std::size_t i = 0; i < views.size(); ++i) {
    if (!views[i].defined()) continue;
    device_grads[i] = {views[i].data_ptr(), views[i].numel(), views.dtype(i)};
    stats->num_elements += views[i].numel();
  }
  const auto on_device = at::TensorOptions().device(device);
  const std::int64_t n = std::max<std::int64_t>(1, static_cast<std::int64_t>(views.size()));
  blame->tensor_sum_squares = at::empty({n}, on_device.dtype(at::kDouble));
  blame->tensor_nonfinite = at::empty({n}, on_device.dtype(at::kInt));
  const bool unscale = options.unscale_in_place && options.inv_scale != 1.0;
  const cuda::DeviceResults results{head.data_ptr<double>(),
                                    blame->tensor_sum_squares.data_ptr<double>(),
                                    blame->tensor_nonfinite.data_ptr<int>()};
  if constexpr (kCurrentStreamLaunch) {
    void* stream = native_handle_of(current);
    inspector_for(device, stream)
        .inspect(device_grads, options.inv_scale, unscale, results, stream);
  } else {
    // LibTorch < 2.11: the launch goes to the legacy default stream, which is PyTorch's default
    // stream. A current stream other than that one (every pool stream is non-blocking: the legacy
    // stream does not order against it) is ordered both ways with c10::Events, on the device
    // (no host wait): the default stream waits for the current one's work so far, and the current
    // one waits for the launch. The inspector runs with the default stream current, so the
    // caching allocator ties its buffers to the stream that reads them. The results, the blame
    // tensors and any contiguous copy were allocated on the current stream: they are written on
    // the default stream, and the current stream's wait orders any reuse of them after that.
    const c10::Stream default_stream = cuda_impl.getDefaultStream(device);
    const bool other_stream = current != default_stream;
    if (other_stream) {
      c10::Event ready(c10::DeviceType::CUDA);
      ready.record(current);
      ready.block(default_stream);
    }
    {
      const c10::StreamGuard on_default(default_stream);
      inspector_for(device, nullptr)
          .inspect(device_grads, options.inv_scale, unscale, results, nullptr);
    }
    if (other_stream) {
      c10::Event launched(c10::DeviceType::CUDA);
      launched.record(default_stream);
      launched.block(current);
    }
  }
  if (unscale) views.copy_back();
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
    for (std::int64_t b = 0; b < n; b += kChunkElements) {
      chunks.push_back({base + b * element_bytes(dt), std::min(kChunkElements, n - b),
                        static_cast<std::int32_t>(i), dt});
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
  GradViews views(grads);
  const at::Tensor* first = validate(grads, head, &views);
  *out = LocalStats();
  *blame = DeferredBlame();
  out->num_tensors = static_cast<std::int64_t>(grads.size());
  out->tensor_sum_squares.assign(grads.size(), 0.0);
  if (first != nullptr && first->is_cuda()) {
    inspect_on_cuda(views, options, head, out, blame);
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
