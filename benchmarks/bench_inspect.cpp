// CPU gradient inspection against the torch way and a read bandwidth ceiling, in one run.
//   build/bin/bench_inspect [--benchmark_format=json]
// The fused case reports user counters vs_torch (torch-way time / inspection time) and
// vs_ceiling (inspection throughput / plain-sum throughput) over the same tensors.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <chrono>
#include <vector>

#include "csrc/inspect/inspect.h"

namespace {

using Clock = std::chrono::steady_clock;

// D1s: a few large fp32 tensors (~64 MB); D2: 2,000 tensors of 4,096 fp32 elements (~32 MB).
std::vector<at::Tensor> make_set(const std::string& name) {
  at::manual_seed(0);
  std::vector<at::Tensor> grads;
  if (name == "D1s") {
    for (std::int64_t n : {4096 * 1024, 4096 * 1024, 2048 * 2048, 11008 * 512}) {
      grads.push_back(at::randn({n}));
    }
  } else {
    for (int i = 0; i < 2000; ++i) grads.push_back(at::randn({4096}));
  }
  return grads;
}

double seconds_of(const std::function<void()>& fn, int reps) {
  fn();  // warm
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) fn();
  return std::chrono::duration<double>(Clock::now() - t0).count() / reps;
}

void torch_way(const std::vector<at::Tensor>& grads) {
  bool finite = true;
  double sq = 0;
  for (const auto& g : grads) {
    finite = finite && at::isfinite(g).all().item<bool>();
    const double n = g.norm().item<double>();
    sq += n * n;
  }
  benchmark::DoNotOptimize(finite);
  benchmark::DoNotOptimize(sq);
}

void ceiling(const std::vector<at::Tensor>& grads) {
  float total = 0;
  for (const auto& g : grads) {
    const float* p = g.data_ptr<float>();
    const std::int64_t n = g.numel();
    float acc[16] = {};
    std::int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      for (int k = 0; k < 16; ++k) acc[k] += p[i + k];
    }
    for (; i < n; ++i) acc[0] += p[i];
    for (float a : acc) total += a;
  }
  benchmark::DoNotOptimize(total);
}

std::int64_t bytes_of(const std::vector<at::Tensor>& grads) {
  std::int64_t b = 0;
  for (const auto& g : grads) b += g.numel() * g.element_size();
  return b;
}

void BM_Fused(benchmark::State& state, const std::string& set) {
  const auto grads = make_set(set);
  for (auto _ : state) {
    auto s = stepguard::inspect::inspect_gradients(grads);
    benchmark::DoNotOptimize(s.sum_squares);
  }
  state.SetBytesProcessed(state.iterations() * bytes_of(grads));
  const double fused = seconds_of([&] { stepguard::inspect::inspect_gradients(grads); }, 5);
  state.counters["vs_torch"] = seconds_of([&] { torch_way(grads); }, 5) / fused;
  state.counters["vs_ceiling"] = seconds_of([&] { ceiling(grads); }, 5) / fused;
}

void BM_TorchWay(benchmark::State& state, const std::string& set) {
  const auto grads = make_set(set);
  for (auto _ : state) torch_way(grads);
  state.SetBytesProcessed(state.iterations() * bytes_of(grads));
}

void BM_Ceiling(benchmark::State& state, const std::string& set) {
  const auto grads = make_set(set);
  for (auto _ : state) ceiling(grads);
  state.SetBytesProcessed(state.iterations() * bytes_of(grads));
}

}  // namespace

BENCHMARK_CAPTURE(BM_Fused, D1s, std::string("D1s"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_TorchWay, D1s, std::string("D1s"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Ceiling, D1s, std::string("D1s"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Fused, D2, std::string("D2"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_TorchWay, D2, std::string("D2"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Ceiling, D2, std::string("D2"))->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
