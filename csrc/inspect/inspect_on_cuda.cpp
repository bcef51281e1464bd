// The CUDA launch of inspect_into(): ATen glue around cuda::FusedInspector.
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "csrc/inspect/cuda/inspect_cuda.h"
#include "csrc/inspect/grad_views.h"

namespace stepguard {
namespace inspect {
namespace detail {
namespace {

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
cuda::FusedInspector& inspector_for(at::Device device, void* stream, int table) {
  struct Entry {
    int device;
    void* stream;
    int table;
    std::uint64_t used;
    std::unique_ptr<cuda::FusedInspector> inspector;
  };
  constexpr std::size_t kMaxInspectors = 8;
  thread_local std::vector<Entry> cache;
  thread_local std::uint64_t calls = 0;
  ++calls;
  for (Entry& e : cache) {
    if (e.device == device.index() && e.stream == stream && e.table == table) {
      e.used = calls;
      return *e.inspector;
    }
  }
  auto made = std::make_unique<cuda::FusedInspector>(device.index(), caching_allocator(device));
  if (cache.size() >= kMaxInspectors) {
    cache.erase(std::min_element(cache.begin(), cache.end(),
                                 [](const Entry& a, const Entry& b) { return a.used < b.used; }));
  }
  cache.push_back({device.index(), stream, table, calls, std::move(made)});
  return *cache.back().inspector;
}

}  // namespace

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
    device_grads[i] = {views[i].data_ptr(), views[i].numel(), views.dtype(i),
                       i < options.nonnegative.size() && options.nonnegative[i] != 0};
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
    inspector_for(device, stream, options.table)
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
      inspector_for(device, nullptr, options.table)
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
}  // namespace detail
}  // namespace inspect
}  // namespace stepguard
