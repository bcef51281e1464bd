/*
 * One checking macro, as NCCL and apex have theirs: every CUDA runtime call goes through
 * SG_CUDA_CHECK, and every kernel launch is followed by SG_CUDA_LAUNCH_CHECK (NCCL, opened at run
 * time, is checked in csrc/consensus/nccl_probe.cpp).
 * A failure throws std::runtime_error naming the call, the place and the library's error string.
 * Include only from files built with the CUDA toolkit on the include path.
 */
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#define SG_STRINGIFY_IMPL(x) #x
#define SG_STRINGIFY(x) SG_STRINGIFY_IMPL(x)

#define SG_CUDA_CHECK(expr)                                                                     \
  do {                                                                                          \
    const cudaError_t sg_err_ = (expr);                                                         \
    if (sg_err_ != cudaSuccess) {                                                               \
      throw std::runtime_error(std::string("stepguard: CUDA call " #expr " failed at " __FILE__ \
                                           ":" SG_STRINGIFY(__LINE__) ": ") +                   \
                               cudaGetErrorName(sg_err_) + ": " + cudaGetErrorString(sg_err_)); \
    }                                                                                           \
  } while (0)

#define SG_CUDA_LAUNCH_CHECK() SG_CUDA_CHECK(cudaGetLastError())
