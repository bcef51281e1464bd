#include "csrc/checkpoint/rng_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <mutex>

namespace stepguard {
namespace checkpoint {

int rng_cuda_devices() {
  return at::detail::getCUDAHooks().hasCUDA() ? at::detail::getCUDAHooks().getNumGPUs() : 0;
}

RngState capture_rng() {
  RngState s;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.cpu = gen.get_state();
  }
  for (int d = 0; d < rng_cuda_devices(); ++d) {
    auto gen = at::globalContext().defaultGenerator(at::Device(at::kCUDA, d));
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.cuda.push_back(gen.get_state());
  }
  return s;
}

void restore_rng(const RngState& state) {
  if (state.empty()) return;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state.cpu);
  }
  const int devices = rng_cuda_devices();
  for (std::size_t d = 0; d < state.cuda.size() && static_cast<int>(d) < devices; ++d) {
    auto gen = at::globalContext().defaultGenerator(at::Device(at::kCUDA, static_cast<int>(d)));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state.cuda[d]);
  }
}

void check_rng(const RngState& state) {
  if (!state.cpu.defined()) return;
  at::Generator scratch = at::make_generator<at::CPUGeneratorImpl>();
  try {
    scratch.set_state(state.cpu);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "its CPU random-generator state is refused by torch (", e.msg(), ")");
  }
}

}  // namespace checkpoint
}  // namespace stepguard
