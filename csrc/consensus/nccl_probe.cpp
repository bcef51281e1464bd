#include "csrc/consensus/nccl_probe.h"

#include <stdexcept>
#include <vector>

#if defined(STEPGUARD_WITH_CUDA)
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "csrc/common/cuda_check.h"
#endif

namespace stepguard {
namespace consensus {

int nccl_version() noexcept {
#if defined(STEPGUARD_WITH_CUDA)
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) return 0;
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
  SG_CUDA_CHECK(cudaSetDevice(0));
  ncclComm_t comm = nullptr;
  int devices[1] = {0};
  SG_NCCL_CHECK(ncclCommInitAll(&comm, 1, devices));
  const std::vector<double> host = {1.0, 2.5, -3.0, 4.0};
  std::vector<double> back(host.size(), 0.0);
  double* buffer = nullptr;
  try {
    SG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&buffer), host.size() * sizeof(double)));
    SG_CUDA_CHECK(
        cudaMemcpy(buffer, host.data(), host.size() * sizeof(double), cudaMemcpyHostToDevice));
    SG_NCCL_CHECK(ncclAllReduce(buffer, buffer, host.size(), ncclFloat64, ncclSum, comm, nullptr));
    SG_CUDA_CHECK(cudaStreamSynchronize(nullptr));
    SG_CUDA_CHECK(
        cudaMemcpy(back.data(), buffer, host.size() * sizeof(double), cudaMemcpyDeviceToHost));
  } catch (...) {
    cudaFree(buffer);
    ncclCommDestroy(comm);
    throw;
  }
  cudaFree(buffer);
  SG_NCCL_CHECK(ncclCommDestroy(comm));
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
