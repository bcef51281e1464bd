#include "stepguard/version.h"

#include <torch/version.h>

#include <string>

#include "csrc/consensus/nccl_probe.h"
#include "csrc/inspect/cuda/inspect_cuda.h"

namespace stepguard {

const char* version() noexcept { return STEPGUARD_VERSION_STRING; }

const char* build_info() noexcept {
  static const std::string info = [] {
    std::string s =
        std::string("stepguard ") + STEPGUARD_VERSION_STRING + " libtorch " + TORCH_VERSION;
    if (cuda::compiled_with_cuda()) {
      const int v = consensus::nccl_version();
      s += v == 0 ? std::string(" cuda yes nccl none")
                  : " cuda yes nccl " + std::to_string(v / 10000) + "." +
                        std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
    } else {
      s += " cuda no";
    }
    return s;
  }();
  return info.c_str();
}

}  // namespace stepguard
