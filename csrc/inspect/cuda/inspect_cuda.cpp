// Host dispatch for the CUDA inspection path, in plain C++.
#include "csrc/inspect/cuda/inspect_cuda.h"

#include <cstring>
#include <stdexcept>
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

// What identifies a gradient set: the table is rebuilt only when this changes.
bool same_set(const std::vector<DeviceGradient>& a, const std::vector<DeviceGradient>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].data != b[i].data || a[i].numel != b[i].numel || a[i].dtype != b[i].dtype) {
      return false;
    }
  }
  return true;
}

}  // namespace

struct FusedInspector::State {
  int device = 0;
  int grid = 1;
  std::vector<DeviceGradient> set;
  bool built = false;
  int num_chunks = 0;
  DeviceBuffer chunks;
  DeviceBuffer partials;
  DeviceBuffer done_counter;
  std::int64_t launches = 0;
  std::int64_t table_builds = 0;
};

FusedInspector::FusedInspector(int device) : state_(std::make_unique<State>()) {
  std::string why;
  if (device_count(&why) == 0) throw std::runtime_error("stepguard: no CUDA device: " + why);
  state_->device = device;
  SG_CUDA_CHECK(cudaSetDevice(device));
  int sms = 0;
  SG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  state_->grid = 4 * sms;  // persistent: a few resident blocks per SM walk the chunk table
  state_->done_counter = DeviceBuffer(sizeof(unsigned int));
  SG_CUDA_CHECK(cudaMemset(state_->done_counter.ptr, 0, sizeof(unsigned int)));
}

FusedInspector::~FusedInspector() = default;

void FusedInspector::inspect(const std::vector<DeviceGradient>& grads, double inv_scale,
                             bool unscale, const DeviceResults& results, void* stream) {
  State& s = *state_;
  if (results.global == nullptr) throw std::invalid_argument("stepguard: results.global is null");
  SG_CUDA_CHECK(cudaSetDevice(s.device));
  if (!s.built || !same_set(grads, s.set)) {
    std::vector<ChunkDesc> table;
    for (std::size_t t = 0; t < grads.size(); ++t) {
      for (std::int64_t b = 0; b < grads[t].numel; b += inspect::kChunkElements) {
        const std::int64_t count = std::min(inspect::kChunkElements, grads[t].numel - b);
        table.push_back({reinterpret_cast<std::uint64_t>(grads[t].data), b, count,
                         static_cast<std::int32_t>(t), static_cast<std::int32_t>(grads[t].dtype)});
      }
    }
    // Synchronous copy on purpose: a rebuild happens only when the gradient set changes.
    s.chunks = DeviceBuffer(std::max<std::size_t>(1, table.size()) * sizeof(ChunkDesc));
    s.partials = DeviceBuffer(std::max<std::size_t>(1, table.size()) * sizeof(inspect::ChunkStats));
    if (!table.empty()) {
      SG_CUDA_CHECK(cudaMemcpy(s.chunks.ptr, table.data(), table.size() * sizeof(ChunkDesc),
                               cudaMemcpyHostToDevice));
    }
    s.num_chunks = static_cast<int>(table.size());
    s.set = grads;
    s.built = true;
    ++s.table_builds;
  }
  if (s.num_chunks == 0) {
    // Nothing to read: the results are zero.
    SG_CUDA_CHECK(
        cudaMemsetAsync(results.global, 0, 4 * sizeof(double), static_cast<cudaStream_t>(stream)));
    if (results.tensor_sum_squares && !grads.empty()) {
      SG_CUDA_CHECK(cudaMemsetAsync(results.tensor_sum_squares, 0, grads.size() * sizeof(double),
                                    static_cast<cudaStream_t>(stream)));
    }
    if (results.tensor_nonfinite && !grads.empty()) {
      SG_CUDA_CHECK(cudaMemsetAsync(results.tensor_nonfinite, 0,
                                    grads.size() * sizeof(std::int32_t),
                                    static_cast<cudaStream_t>(stream)));
    }
    return;
  }
  const int grid = std::min(s.grid, s.num_chunks);
  launch_fused_inspect(static_cast<const ChunkDesc*>(s.chunks.ptr), s.num_chunks,
                       static_cast<int>(grads.size()), inv_scale, unscale,
                       static_cast<inspect::ChunkStats*>(s.partials.ptr),
                       static_cast<unsigned int*>(s.done_counter.ptr), results, grid, stream);
  ++s.launches;
}

std::int64_t FusedInspector::launches() const noexcept { return state_->launches; }
std::int64_t FusedInspector::table_builds() const noexcept { return state_->table_builds; }

HostInspection inspect_host_on_device(const std::vector<std::vector<std::uint8_t>>& bytes,
                                      const std::vector<inspect::GradDtype>& dtypes,
                                      double inv_scale, bool unscale, std::size_t misalign_bytes) {
  if (bytes.size() != dtypes.size()) throw std::invalid_argument("bytes and dtypes differ in size");
  if (misalign_bytes % 8 != 0) {
    // Scalar loads must stay naturally aligned for every dtype (a misaligned load poisons the
    // context); 8 bytes still defeats the 16-byte vector loads.
    throw std::invalid_argument("stepguard: misalign_bytes must be a multiple of 8, got " +
                                std::to_string(misalign_bytes));
  }
  FusedInspector inspector(0);
  std::vector<DeviceBuffer> buffers;
  std::vector<DeviceGradient> grads;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    buffers.emplace_back(bytes[i].size() + misalign_bytes + 16);
    auto* base = static_cast<std::uint8_t*>(buffers.back().ptr) + misalign_bytes;
    if (!bytes[i].empty()) {
      SG_CUDA_CHECK(cudaMemcpy(base, bytes[i].data(), bytes[i].size(), cudaMemcpyHostToDevice));
    }
    const auto size = static_cast<std::int64_t>(inspect::element_bytes(dtypes[i]));
    grads.push_back({base, static_cast<std::int64_t>(bytes[i].size()) / size, dtypes[i]});
  }
  DeviceBuffer global(4 * sizeof(double));
  DeviceBuffer sums(std::max<std::size_t>(1, bytes.size()) * sizeof(double));
  DeviceBuffer flags(std::max<std::size_t>(1, bytes.size()) * sizeof(std::int32_t));
  DeviceResults results{static_cast<double*>(global.ptr), static_cast<double*>(sums.ptr),
                        static_cast<std::int32_t*>(flags.ptr)};
  inspector.inspect(grads, inv_scale, unscale, results, nullptr);
  SG_CUDA_CHECK(cudaDeviceSynchronize());

  HostInspection out;
  double g[4];
  SG_CUDA_CHECK(cudaMemcpy(g, global.ptr, sizeof g, cudaMemcpyDeviceToHost));
  out.global.nan_count = static_cast<std::int64_t>(g[0]);
  out.global.inf_count = static_cast<std::int64_t>(g[1]);
  out.global.sum_squares = g[2];
  out.overflow = g[3] != 0.0;
  out.tensor_sum_squares.resize(bytes.size());
  out.tensor_nonfinite.resize(bytes.size());
  if (!bytes.empty()) {
    SG_CUDA_CHECK(cudaMemcpy(out.tensor_sum_squares.data(), sums.ptr, bytes.size() * sizeof(double),
                             cudaMemcpyDeviceToHost));
    SG_CUDA_CHECK(cudaMemcpy(out.tensor_nonfinite.data(), flags.ptr,
                             bytes.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  }
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    out.unscaled.emplace_back(bytes[i].size());
    if (!bytes[i].empty()) {
      SG_CUDA_CHECK(cudaMemcpy(out.unscaled.back().data(), grads[i].data, bytes[i].size(),
                               cudaMemcpyDeviceToHost));
    }
  }
  return out;
}

#else  // no CUDA in this build

struct FusedInspector::State {};
FusedInspector::FusedInspector(int) { throw std::runtime_error("stepguard: built without CUDA"); }
FusedInspector::~FusedInspector() = default;
void FusedInspector::inspect(const std::vector<DeviceGradient>&, double, bool, const DeviceResults&,
                             void*) {
  throw std::runtime_error("stepguard: built without CUDA");
}
std::int64_t FusedInspector::launches() const noexcept { return 0; }
std::int64_t FusedInspector::table_builds() const noexcept { return 0; }
HostInspection inspect_host_on_device(const std::vector<std::vector<std::uint8_t>>&,
                                      const std::vector<inspect::GradDtype>&, double, bool,
                                      std::size_t) {
  throw std::runtime_error("stepguard: built without CUDA");
}

#endif

}  // namespace cuda
}  // namespace stepguard
