#include "csrc/consensus/nccl_probe.h"

#include <stdexcept>
#include <vector>

#if defined(STEPGUARD_WITH_CUDA)
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include "csrc/common/cuda_check.h"
#endif

namespace stepguard {
namespace consensus {

#if defined(STEPGUARD_WITH_CUDA)
namespace {

// NCCL is opened when present, never a needed library: a CPU-only torch ships none, and the
// library must load beside it. A CUDA torch's libtorch_cuda needs libnccl.so.2, so in a process
// that uses CUDA it is already loaded (RTLD_NOLOAD finds that copy); otherwise the usual search
// (LD_LIBRARY_PATH, this library's run path) may find one, and none means "no NCCL".
struct Nccl {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclCommInitAll) comm_init_all = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
};

template <typename F>
bool resolve(void* handle, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(handle, name));
  return *out != nullptr;
}

const Nccl* nccl() {
  static const Nccl* loaded = []() -> const Nccl* {
    void* handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (handle == nullptr) handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) return nullptr;
    static Nccl api;
    const bool all = resolve(handle, "ncclGetVersion", &api.get_version) &&
                     resolve(handle, "ncclGetErrorString", &api.error_string) &&
                     resolve(handle, "ncclCommInitAll", &api.comm_init_all) &&
                     resolve(handle, "ncclCommDestroy", &api.comm_destroy) &&
                     resolve(handle, "ncclAllReduce", &api.all_reduce);
    return all ? &api : nullptr;  // the handle stays open for the process's lifetime
  }();
  return loaded;
}

void check(const Nccl& api, ncclResult_t result, const char* call) {
  if (result != ncclSuccess)
    throw std::runtime_error(std::string("stepguard: NCCL call ") + call +
                             " failed: " + api.error_string(result));
}

}  // namespace
#endif

int nccl_version() noexcept {
#if defined(STEPGUARD_WITH_CUDA)
  const Nccl* api = nccl();
  int version = 0;
  if (api == nullptr || api->get_version(&version) != ncclSuccess) return 0;
  return version;
#else
  return 0;
#endif
}

bool nccl_self_test(std::string* why) {
#if defined(STEPGUARD_WITH_CUDA)
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    if (why) *why = err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA device";
    return false;
  }
  const Nccl* api = nccl();
  if (api == nullptr) {
    if (why) *why = "libnccl.so.2 is not loaded and was not found";
    return false;
  }
  SG_CUDA_CHECK(cudaSetDevice(0));
  ncclComm_t comm = nullptr;
  int devices[1] = {0};
  check(*api, api->comm_init_all(&comm, 1, devices), "ncclCommInitAll");
  const std::vector<double> host = {1.0, 2.5, -3.0, 4.0};
  std::vector<double> back(host.size(), 0.0);
  double* buffer = nullptr;
  try {
    SG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&buffer), host.size() * sizeof(double)));
    SG_CUDA_CHECK(
        cudaMemcpy(buffer, host.data(), host.size() * sizeof(double), cudaMemcpyHostToDevice));
    check(*api, api->all_reduce(buffer, buffer, host.size(), ncclFloat64, ncclSum, comm, nullptr),
          "ncclAllReduce");
    SG_CUDA_CHECK(cudaStreamSynchronize(nullptr));
    SG_CUDA_CHECK(
        cudaMemcpy(back.data(), buffer, host.size() * sizeof(double), cudaMemcpyDeviceToHost));
  } catch (...) {
    cudaFree(buffer);
    api->comm_destroy(comm);
    throw;
  }
  cudaFree(buffer);
  check(*api, api->comm_destroy(comm), "ncclCommDestroy");
  if (back != host)
    throw std::runtime_error("stepguard: NCCL one-rank all-reduce changed the data");
  return true;
#else
  if (why) *why = "stepguard was built without CUDA/NCCL";
  return false;
#endif
}

}  // namespace consensus
}  // namespace stepguard
