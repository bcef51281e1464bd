// Host dispatch for the CUDA inspection path, in plain C++.
#include "csrc/inspect/cuda/inspect_cuda.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#if defined(STEPGUARD_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "csrc/common/cuda_check.h"
#endif

namespace stepguard {
namespace cuda {

bool compiled_with_cuda() noexcept {
#if defined(STEPGUARD_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

int device_count(std::string* why) noexcept {
#if defined(STEPGUARD_WITH_CUDA)
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why) *why = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return 0;
  }
  if (count == 0 && why) *why = "the CUDA driver reports no device";
  return count;
#else
  if (why) *why = "stepguard was built without CUDA (no nvcc or NCCL at configure time)";
  return 0;
#endif
}

#if defined(STEPGUARD_WITH_CUDA)
namespace {

// Device memory freed on every path out.
struct DeviceBuffer {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) : bytes(n) {
    if (n > 0) SG_CUDA_CHECK(cudaMalloc(&ptr, n));
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), bytes(o.bytes) {
    o.ptr = nullptr;
    o.bytes = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(bytes, o.bytes);
    return *this;
  }
};

// Makes `device` current for the scope and restores the caller's device at its end: no call leaves
// the thread's current device changed. (Under inspect_into() a c10::DeviceGuard has already made
// the gradients' device current, so this sets nothing there.)
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    SG_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      SG_CUDA_CHECK(cudaSetDevice(device));
      changed_ = true;
    }
  }
  ~CurrentDevice() {
    if (changed_) cudaSetDevice(previous_);  // it was current a moment ago: nothing to report
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// The default DeviceAllocator. Safe to drop while a kernel still reads the memory: cudaFree waits
// for the device (which is why the torch side passes its caching allocator instead).
std::shared_ptr<void> cuda_malloc(std::size_t bytes) {
  void* p = nullptr;
  SG_CUDA_CHECK(cudaMalloc(&p, bytes));
  return std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
}

constexpr std::size_t kScratchAlign = 256;
std::size_t round_up(std::size_t n) {
  return (n + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
}

// Pinned host memory the chunk table is copied from. From pageable memory, cudaMemcpyAsync first
// waits for the stream (a host synchronization on every rebuild); from pinned memory it is a plain
// stream-ordered DMA. `copied` marks the last copy out of it: the buffer is rewritten only after
// that copy completed, which on the next rebuild (a step later) it long has.
struct PinnedStaging {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  cudaEvent_t copied = nullptr;

  PinnedStaging() = default;
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;
  ~PinnedStaging() {
    if (copied) {
      cudaEventSynchronize(copied);
      cudaEventDestroy(copied);
    }
    if (ptr) cudaFreeHost(ptr);
  }

  // Room for `n` bytes that no pending copy reads. Called with the inspector's device current.
  void* reserve(std::size_t n) {
    if (copied) {
      SG_CUDA_CHECK(cudaEventSynchronize(copied));
    } else {
      SG_CUDA_CHECK(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming));
    }
    if (n > bytes) {
      const std::size_t grown = std::max(n, 2 * bytes);  // rare: amortized over rebuilds
      if (ptr) cudaFreeHost(ptr);
      ptr = nullptr;
      bytes = 0;
      SG_CUDA_CHECK(cudaHostAlloc(&ptr, grown, cudaHostAllocDefault));
      bytes = grown;
    }
    return ptr;
  }
};

// What identifies a gradient set: the table is rebuilt only when this changes.
bool same_set(const std::vector<DeviceGradient>& a, const std::vector<DeviceGradient>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].data != b[i].data || a[i].numel != b[i].numel || a[i].dtype != b[i].dtype ||
        a[i].nonnegative != b[i].nonnegative) {
      return false;
    }
  }
  return true;
}

}  // namespace

struct FusedInspector::State {
  int device = 0;
  int grid = 1;
  DeviceAllocator allocate;
  std::vector<DeviceGradient> set;
  cudaStream_t stream = nullptr;  ///< the stream the table and scratch were built for
  bool built = false;
  int num_chunks = 0;
  // Table, chunk partials and done counter: one allocation, from `allocate`, made for `stream`.
  std::shared_ptr<void> scratch;
  const ChunkDesc* chunks = nullptr;
  inspect::ChunkStats* partials = nullptr;
  unsigned int* done_counter = nullptr;
  PinnedStaging staging;
  std::int64_t launches = 0;
  std::int64_t table_builds = 0;

  void rebuild(const std::vector<DeviceGradient>& grads, cudaStream_t on);
};

// Everything here is enqueued on `on`: no host synchronization (beyond the staging buffer's
// previous copy, long complete), no device-wide call.
void FusedInspector::State::rebuild(const std::vector<DeviceGradient>& grads, cudaStream_t on) {
  // A rebuild cannot be captured: the allocation may not be capturable, the staging buffer is
  // rewritten by later rebuilds, and a graph replaying a table copy would carry a table whose
  // scratch this inspector frees. Refuse before enqueuing anything, so the capture stays intact.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  SG_CUDA_CHECK(cudaStreamIsCapturing(on, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    throw std::runtime_error(
        "stepguard: the CUDA gradient inspection must build its chunk table (first call on this "
        "stream, or the gradients were reallocated) while the stream is being captured into a "
        "CUDA graph; a rebuild cannot be captured. Run one step on the capture stream before "
        "capturing, and capture again after the gradients change");
  }
  std::size_t n = 0;
  for (const auto& g : grads) {
    if (g.numel > 0) {
      n += static_cast<std::size_t>((g.numel + inspect::kChunkElements - 1) /
                                    inspect::kChunkElements);
    }
  }
  if (n > static_cast<std::size_t>(INT_MAX)) {
    throw std::runtime_error("stepguard: too many gradient chunks for one launch: " +
                             std::to_string(n));
  }
  std::shared_ptr<void> fresh;
  const ChunkDesc* fresh_chunks = nullptr;
  inspect::ChunkStats* fresh_partials = nullptr;
  unsigned int* fresh_counter = nullptr;
  if (n > 0) {
    const std::size_t table_bytes = n * sizeof(ChunkDesc);
    const std::size_t table_room = round_up(table_bytes);
    const std::size_t partial_room = round_up(n * sizeof(inspect::ChunkStats));
    fresh = allocate ? allocate(table_room + partial_room + sizeof(unsigned int))
                     : cuda_malloc(table_room + partial_room + sizeof(unsigned int));
    if (!fresh) throw std::runtime_error("stepguard: the inspection's device allocator failed");
    auto* base = static_cast<unsigned char*>(fresh.get());
    auto* host = static_cast<ChunkDesc*>(staging.reserve(table_bytes));
    std::size_t c = 0;
    for (std::size_t t = 0; t < grads.size(); ++t) {
      for (std::int64_t b = 0; b < grads[t].numel; b += inspect::kChunkElements) {
        const std::int64_t count = std::min(inspect::kChunkElements, grads[t].numel - b);
        host[c++] = {reinterpret_cast<std::uint64_t>(grads[t].data),
                     b,
                     count,
                     static_cast<std::int32_t>(t),
                     static_cast<std::int32_t>(grads[t].dtype),
                     grads[t].nonnegative ? 1 : 0,
                     0};
      }
    }
    SG_CUDA_CHECK(cudaMemcpyAsync(base, host, table_bytes, cudaMemcpyHostToDevice, on));
    SG_CUDA_CHECK(cudaEventRecord(staging.copied, on));
    fresh_chunks = reinterpret_cast<const ChunkDesc*>(base);
    fresh_partials = reinterpret_cast<inspect::ChunkStats*>(base + table_room);
    fresh_counter = reinterpret_cast<unsigned int*>(base + table_room + partial_room);
    SG_CUDA_CHECK(cudaMemsetAsync(fresh_counter, 0, sizeof(unsigned int), on));
  }
  // The old scratch goes back to its allocator here, while a kernel enqueued on the old stream may
  // still read it. It was allocated for that stream and used on it only (a new stream always gets
  // a rebuild), so DeviceAllocator's contract makes this safe: cudaFree waits for the device, and
  // PyTorch's caching allocator reuses the block only for work ordered after that kernel.
  scratch = std::move(fresh);
  chunks = fresh_chunks;
  partials = fresh_partials;
  done_counter = fresh_counter;
  num_chunks = static_cast<int>(n);
  set = grads;
  stream = on;
  built = true;
  ++table_builds;
}

FusedInspector::FusedInspector(int device, DeviceAllocator allocate)
    : state_(std::make_unique<State>()) {
  std::string why;
  if (device_count(&why) == 0) throw std::runtime_error("stepguard: no CUDA device: " + why);
  // Makes `device` current (the occupancy query below needs it; the cudaSetDevice that follows is
  // then a no-op) and gives the caller's device back when the constructor returns.
  const CurrentDevice restore_callers_device(device);
  state_->device = device;
  state_->allocate = std::move(allocate);
  SG_CUDA_CHECK(cudaSetDevice(device));
  int sms = 0;
  SG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // Persistent: every block that fits on an SM at once (occupancy of the real kernel) walks the
  // chunk table.
  state_->grid = std::max(1, fused_inspect_blocks_per_sm() * sms);
  // No allocation here: the table, partials and done counter come with the first inspect(), on its
  // stream and from its allocator.
}

FusedInspector::~FusedInspector() = default;

void FusedInspector::inspect(const std::vector<DeviceGradient>& grads, double inv_scale,
                             bool unscale, const DeviceResults& results, void* stream) {
  State& s = *state_;
  if (results.global == nullptr) throw std::invalid_argument("stepguard: results.global is null");
  const CurrentDevice restore_callers_device(s.device);
  const auto on = static_cast<cudaStream_t>(stream);
  // A new stream gets its own scratch: the partials and done counter of a launch still running on
  // the old stream are never shared, and every allocation is used on the one stream it was made
  // for (see rebuild()).
  if (!s.built || on != s.stream || !same_set(grads, s.set)) s.rebuild(grads, on);
  if (s.num_chunks == 0) {
    // Nothing to read: the results are zero.
    SG_CUDA_CHECK(cudaMemsetAsync(results.global, 0, 4 * sizeof(double), on));
    if (results.tensor_sum_squares && !grads.empty()) {
      SG_CUDA_CHECK(
          cudaMemsetAsync(results.tensor_sum_squares, 0, grads.size() * sizeof(double), on));
    }
    if (results.tensor_nonfinite && !grads.empty()) {
      SG_CUDA_CHECK(
          cudaMemsetAsync(results.tensor_nonfinite, 0, grads.size() * sizeof(std::int32_t), on));
    }
    return;
  }
  const int grid = std::min(s.grid, s.num_chunks);
  launch_fused_inspect(s.chunks, s.num_chunks, static_cast<int>(grads.size()), inv_scale, unscale,
                       s.partials, s.done_counter, results, grid, stream);
  ++s.launches;
}

std::int64_t FusedInspector::launches() const noexcept { return state_->launches; }
std::int64_t FusedInspector::table_builds() const noexcept { return state_->table_builds; }

HostInspection inspect_host_on_device(const std::vector<std::vector<std::uint8_t>>& bytes,
                                      const std::vector<inspect::GradDtype>& dtypes,
                                      double inv_scale, bool unscale, std::size_t misalign_bytes,
                                      void* stream) {
  if (bytes.size() != dtypes.size()) throw std::invalid_argument("bytes and dtypes differ in size");
  if (misalign_bytes % 8 != 0) {
    // Scalar loads must stay naturally aligned for every dtype (a misaligned load poisons the
    // context); 8 bytes still defeats the 16-byte vector loads.
    throw std::invalid_argument("stepguard: misalign_bytes must be a multiple of 8, got " +
                                std::to_string(misalign_bytes));
  }
  // The inspector first: it is what reports a missing device. The buffers below are cudaMalloc'ed
  // on device 0.
  FusedInspector inspector(0);
  const CurrentDevice restore_callers_device(0);
  const auto on = static_cast<cudaStream_t>(stream);
  std::vector<DeviceBuffer> buffers;
  std::vector<DeviceGradient> grads;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    buffers.emplace_back(bytes[i].size() + misalign_bytes + 16);
    auto* base = static_cast<std::uint8_t*>(buffers.back().ptr) + misalign_bytes;
    if (!bytes[i].empty()) {
      SG_CUDA_CHECK(
          cudaMemcpyAsync(base, bytes[i].data(), bytes[i].size(), cudaMemcpyHostToDevice, on));
    }
    const auto size = static_cast<std::int64_t>(inspect::element_bytes(dtypes[i]));
    grads.push_back({base, static_cast<std::int64_t>(bytes[i].size()) / size, dtypes[i]});
  }
  DeviceBuffer global(4 * sizeof(double));
  DeviceBuffer sums(std::max<std::size_t>(1, bytes.size()) * sizeof(double));
  DeviceBuffer flags(std::max<std::size_t>(1, bytes.size()) * sizeof(std::int32_t));
  DeviceResults results{static_cast<double*>(global.ptr), static_cast<double*>(sums.ptr),
                        static_cast<std::int32_t*>(flags.ptr)};
  inspector.inspect(grads, inv_scale, unscale, results, stream);

  // Read back on the same stream (from pageable memory these copies return only once done), then
  // synchronize that stream once more for good measure: nothing else is waited for.
  HostInspection out;
  double g[4];
  SG_CUDA_CHECK(cudaMemcpyAsync(g, global.ptr, sizeof g, cudaMemcpyDeviceToHost, on));
  out.tensor_sum_squares.resize(bytes.size());
  out.tensor_nonfinite.resize(bytes.size());
  if (!bytes.empty()) {
    SG_CUDA_CHECK(cudaMemcpyAsync(out.tensor_sum_squares.data(), sums.ptr,
                                  bytes.size() * sizeof(double), cudaMemcpyDeviceToHost, on));
    SG_CUDA_CHECK(cudaMemcpyAsync(out.tensor_nonfinite.data(), flags.ptr,
                                  bytes.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost, on));
  }
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    out.unscaled.emplace_back(bytes[i].size());
    if (!bytes[i].empty()) {
      SG_CUDA_CHECK(cudaMemcpyAsync(out.unscaled.back().data(), grads[i].data, bytes[i].size(),
                                    cudaMemcpyDeviceToHost, on));
    }
  }
  SG_CUDA_CHECK(cudaStreamSynchronize(on));
  out.global.nan_count = static_cast<std::int64_t>(g[0]);
  out.global.inf_count = static_cast<std::int64_t>(g[1]);
  out.global.sum_squares = g[2];
  out.overflow = g[3] != 0.0;
  return out;
}

#else  // no CUDA in this build

struct FusedInspector::State {};
FusedInspector::FusedInspector(int, DeviceAllocator) {
  throw std::runtime_error("stepguard: built without CUDA");
}
FusedInspector::~FusedInspector() = default;
void FusedInspector::inspect(const std::vector<DeviceGradient>&, double, bool, const DeviceResults&,
                             void*) {
  throw std::runtime_error("stepguard: built without CUDA");
}
std::int64_t FusedInspector::launches() const noexcept { return 0; }
std::int64_t FusedInspector::table_builds() const noexcept { return 0; }
HostInspection inspect_host_on_device(const std::vector<std::vector<std::uint8_t>>&,
                                      const std::vector<inspect::GradDtype>&, double, bool,
                                      std::size_t, void*) {
  throw std::runtime_error("stepguard: built without CUDA");
}

#endif

}  // namespace cuda
}  // namespace stepguard
