/*
 * NCCL availability, for the GPU checks and the build-info line: proves NCCL loads and, on a GPU,
 * runs. NCCL is opened at run time when present (a CPU-only torch ships none); the multi-rank
 * verdict goes through the framework's process group, never through NCCL directly.
 */
#pragma once

#include <string>

namespace stepguard {
namespace consensus {

/// NCCL's version code (e.g. 22703 for 2.27.3), or 0 when the build has no NCCL or the process
/// has none loaded and none can be found.
int nccl_version() noexcept;

/// On a machine with at least one GPU: creates a one-rank communicator on device 0, all-reduces a
/// small fp64 buffer and checks the result. Returns false with `why` filled when there is no GPU;
/// throws std::runtime_error when NCCL or CUDA fails.
bool nccl_self_test(std::string* why);

}  // namespace consensus
}  // namespace stepguard
