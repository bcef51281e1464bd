// GPU gradient inspection against the torch way and a bandwidth ceiling, in one run.
//
//   build/bin/bench_inspect_gpu [--benchmark_format=json]      (needs a GPU and a CUDA LibTorch)
//
// Data sets (GPU sizes): D1 = the Llama-7B-style shapes scaled to ~2 GB fp32; D2 = 20,000 fp32
// tensors of 4,096 elements; D3 = D1 with every other tensor in bf16.
// Cases: Fused (stepguard's one launch), TorchWay (torch._amp_foreach_non_finite_check_and_unscale_
// + torch._foreach_norm, as GradScaler and clip_grad_norm_ do), Ceiling (CUB DeviceReduce::Sum over
// one flat buffer of the same bytes). Fused reports vs_torch, vs_ceiling, GB/s and launches per
// call.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>
#include <torch/cuda.h>

#include <map>
#include <string>
#include <vector>

#include "benchmarks/ceiling_kernel.h"
#include "benchmarks/llama_shapes.h"
#include "csrc/inspect/cuda/inspect_cuda.h"
#include "csrc/inspect/inspect.h"

namespace {

using stepguard::cuda::DeviceGradient;
using stepguard::cuda::FusedInspector;

std::vector<at::Tensor> make_set(const std::string& name) {
  at::manual_seed(0);
  const auto opts = at::TensorOptions().device(at::kCUDA);
  std::vector<at::Tensor> grads;
  if (name == "D2") {
    for (int i = 0; i < 20000; ++i) grads.push_back(at::randn({4096}, opts));
    return grads;
  }
  // Llama-7B shapes scaled by 0.27 per dimension: ~2 GB in fp32.
  const auto shapes = stepguard::bench::llama_shapes(1104, 2976, 8640);
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    auto g = at::randn(shapes[i], opts);
    grads.push_back(name == "D3" && i % 2 == 1 ? g.to(at::kBFloat16) : g);
  }
  return grads;
}

struct Set {
  std::vector<at::Tensor> grads;
  std::vector<DeviceGradient> device;
  std::int64_t bytes = 0;
  at::Tensor flat;  // the same bytes in one buffer, for the ceiling
};

Set& data_set(const std::string& name) {
  static std::map<std::string, Set> sets;
  auto it = sets.find(name);
  if (it != sets.end()) return it->second;
  Set s;
  s.grads = make_set(name);
  for (const auto& g : s.grads) {
    s.device.push_back({g.data_ptr(), g.numel(), stepguard::inspect::grad_dtype_of(g, 0)});
    s.bytes += g.numel() * g.element_size();
  }
  s.flat = at::empty({s.bytes / 4}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA));
  return sets.emplace(name, std::move(s)).first->second;
}

// Mean milliseconds per call over CUDA events.
double time_ms(const std::function<void()>& fn, int reps) {
  fn();
  cudaDeviceSynchronize();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start, nullptr);
  for (int i = 0; i < reps; ++i) fn();
  cudaEventRecord(stop, nullptr);
  cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / reps;
}

void BM_Fused(benchmark::State& state, const std::string& name) {
  if (!torch::cuda::is_available()) {
    state.SkipWithError("no CUDA device or CUDA LibTorch");
    return;
  }
  Set& s = data_set(name);
  FusedInspector inspector(0);
  auto results = at::empty({4 + 2 * static_cast<std::int64_t>(s.grads.size())},
                           at::TensorOptions().dtype(at::kDouble).device(at::kCUDA));
  double* r = results.data_ptr<double>();
  stepguard::cuda::DeviceResults out{r, r + 4, nullptr};
  auto fused = [&] { inspector.inspect(s.device, 1.0, false, out, nullptr); };
  for (auto _ : state) {
    fused();
    cudaDeviceSynchronize();
  }
  const std::int64_t launches_before = inspector.launches();
  const double fused_ms = time_ms(fused, 20);
  const double calls = 21;  // time_ms runs one warm-up call plus 20
  state.counters["launches_per_call"] =
      static_cast<double>(inspector.launches() - launches_before) / calls;

  auto found_inf = at::zeros({1}, at::TensorOptions().device(at::kCUDA));
  auto inv_scale = at::ones({1}, at::TensorOptions().device(at::kCUDA));
  std::vector<at::Tensor> fp32_grads;
  for (const auto& g : s.grads)
    fp32_grads.push_back(g.scalar_type() == at::kFloat ? g : g.to(at::kFloat));
  const double torch_ms = time_ms(
      [&] {
        at::_amp_foreach_non_finite_check_and_unscale_(fp32_grads, found_inf, inv_scale);
        auto norms = at::_foreach_norm(fp32_grads, 2);
        benchmark::DoNotOptimize(norms);
      },
      10);
  const std::size_t temp_bytes = stepguard::bench::cub_sum_temp_bytes(s.bytes / 4);
  auto temp = at::empty({static_cast<std::int64_t>(temp_bytes) + 8},
                        at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
  auto sum = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
  const double ceiling_ms = time_ms(
      [&] {
        stepguard::bench::cub_sum_words(s.flat.data_ptr(), s.bytes / 4, temp.data_ptr(), temp_bytes,
                                        sum.data_ptr(), nullptr);
      },
      20);
  state.counters["fused_GBps"] = s.bytes / (fused_ms * 1e6);
  state.counters["ceiling_GBps"] = s.bytes / (ceiling_ms * 1e6);
  state.counters["vs_ceiling"] = ceiling_ms / fused_ms;
  state.counters["vs_torch"] = torch_ms / fused_ms;
  state.counters["tensors"] = static_cast<double>(s.grads.size());
}

}  // namespace

BENCHMARK_CAPTURE(BM_Fused, D1, std::string("D1"))->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Fused, D2, std::string("D2"))->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Fused, D3, std::string("D3"))->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
