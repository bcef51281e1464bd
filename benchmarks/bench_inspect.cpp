// CPU gradient inspection against the torch way and a memory-bandwidth ceiling, in one run.
//
//   build/bin/bench_inspect [--benchmark_format=json]
//
// Data sets (CPU sizes):
//   D1  the 291 tensor shapes of a Llama-7B-style model (32 layers: q k v o, gate up down, two
//       norms; embedding, final norm, head) with every dimension scaled by 0.086: ~200 MB fp32
//   D2  20,000 fp32 tensors of 4,096 elements (~330 MB): the many-small-tensors case
//   D3  D1 with every other tensor in bf16
// Cases: Fused (stepguard's pass), TorchWay (per tensor isfinite(g).all() + g.norm()), and
// Ceiling (a read-only vectorized sum over the same bytes, parallel over the same chunks).
// The Fused case reports user counters measured in the same run, from alternating blocks of the
// two passes (median block of each, so both see the same drift of a shared machine):
//   vs_torch   = TorchWay time / Fused time
//   vs_ceiling = Fused throughput / Ceiling throughput
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "benchmarks/llama_shapes.h"
#include "csrc/inspect/inspect.h"

namespace {

using Clock = std::chrono::steady_clock;

std::vector<at::Tensor> llama_like(bool mixed) {
  // Every dimension of Llama-7B scaled by 0.086: ~200 MB in fp32.
  const auto shapes = stepguard::bench::llama_shapes(352, 952, 2768);
  std::vector<at::Tensor> grads;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    auto g = at::randn(shapes[i]);
    grads.push_back(mixed && i % 2 == 1 ? g.to(at::kBFloat16) : g);
  }
  return grads;
}

const std::vector<at::Tensor>& data_set(const std::string& name) {
  static std::map<std::string, std::vector<at::Tensor>> sets;
  auto it = sets.find(name);
  if (it != sets.end()) return it->second;
  at::manual_seed(0);
  std::vector<at::Tensor> grads;
  if (name == "D1") {
    grads = llama_like(false);
  } else if (name == "D2") {
    for (int i = 0; i < 20000; ++i) grads.push_back(at::randn({4096}));
  } else {
    grads = llama_like(true);
  }
  return sets.emplace(name, std::move(grads)).first->second;
}

std::int64_t bytes_of(const std::vector<at::Tensor>& grads) {
  std::int64_t b = 0;
  for (const auto& g : grads) b += g.numel() * g.element_size();
  return b;
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

#if defined(__x86_64__) && defined(__GNUC__)
#define SG_BENCH_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SG_BENCH_CLONES
#endif

// The ceiling: read every byte once (as 32-bit words), vectorized, same chunking and threads.
SG_BENCH_CLONES std::uint64_t sum_words(const std::uint32_t* p, std::int64_t n) {
  std::uint64_t acc = 0;
  for (std::int64_t i = 0; i < n; ++i) acc += p[i];
  return acc;
}

void ceiling(const std::vector<at::Tensor>& grads) {
  struct Piece {
    const std::uint32_t* p;
    std::int64_t n;
  };
  std::vector<Piece> pieces;
  for (const auto& g : grads) {
    const auto words = g.numel() * g.element_size() / 4;
    const auto* p = static_cast<const std::uint32_t*>(g.data_ptr());
    for (std::int64_t b = 0; b < words; b += stepguard::inspect::kChunkElements) {
      pieces.push_back({p + b, std::min(stepguard::inspect::kChunkElements, words - b)});
    }
  }
  std::vector<std::uint64_t> partial(pieces.size());
  at::parallel_for(0, static_cast<std::int64_t>(pieces.size()), 4,
                   [&](std::int64_t lo, std::int64_t hi) {
                     for (std::int64_t i = lo; i < hi; ++i) {
                       partial[i] = sum_words(pieces[i].p, pieces[i].n);
                     }
                   });
  std::uint64_t total = 0;
  for (auto v : partial) total += v;
  benchmark::DoNotOptimize(total);
}

void fused(const std::vector<at::Tensor>& grads) {
  auto s = stepguard::inspect::inspect_gradients(grads);
  benchmark::DoNotOptimize(s.sum_squares);
}

// Seconds per call of `fn`, over `reps` calls.
double seconds_of(const std::function<void()>& fn, int reps) {
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) fn();
  return std::chrono::duration<double>(Clock::now() - t0).count() / reps;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// time(baseline) / time(ours), from blocks of each run alternately (about 0.1 s a block, 9 rounds)
// and the median block of each: the load and clock of a shared machine drift within a run, and
// alternating blocks see the same drift.
double speed_ratio(const std::function<void()>& ours, const std::function<void()>& baseline) {
  ours();  // warm
  baseline();
  auto reps_for = [](const std::function<void()>& fn) {
    return std::max(1, static_cast<int>(0.1 / seconds_of(fn, 1)));
  };
  const int reps_ours = reps_for(ours);
  const int reps_base = reps_for(baseline);
  std::vector<double> t_ours;
  std::vector<double> t_base;
  for (int round = 0; round < 9; ++round) {
    t_ours.push_back(seconds_of(ours, reps_ours));
    t_base.push_back(seconds_of(baseline, reps_base));
  }
  return median(t_base) / median(t_ours);
}

void BM_Fused(benchmark::State& state, const std::string& set) {
  const auto& grads = data_set(set);
  for (auto _ : state) fused(grads);
  state.SetBytesProcessed(state.iterations() * bytes_of(grads));
  state.counters["vs_torch"] = speed_ratio([&] { fused(grads); }, [&] { torch_way(grads); });
  state.counters["vs_ceiling"] = speed_ratio([&] { fused(grads); }, [&] { ceiling(grads); });
  state.counters["threads"] = at::get_num_threads();
  state.counters["tensors"] = static_cast<double>(grads.size());
}

void BM_TorchWay(benchmark::State& state, const std::string& set) {
  const auto& grads = data_set(set);
  for (auto _ : state) torch_way(grads);
  state.SetBytesProcessed(state.iterations() * bytes_of(grads));
}

void BM_Ceiling(benchmark::State& state, const std::string& set) {
  const auto& grads = data_set(set);
  for (auto _ : state) ceiling(grads);
  state.SetBytesProcessed(state.iterations() * bytes_of(grads));
}

}  // namespace

#define SG_BENCH_SET(SET)                                \
  BENCHMARK_CAPTURE(BM_Fused, SET, std::string(#SET))    \
      ->Unit(benchmark::kMillisecond)                    \
      ->UseRealTime();                                   \
  BENCHMARK_CAPTURE(BM_TorchWay, SET, std::string(#SET)) \
      ->Unit(benchmark::kMillisecond)                    \
      ->UseRealTime();                                   \
  BENCHMARK_CAPTURE(BM_Ceiling, SET, std::string(#SET))  \
      ->Unit(benchmark::kMillisecond)                    \
      ->UseRealTime()

SG_BENCH_SET(D1);
SG_BENCH_SET(D2);
SG_BENCH_SET(D3);

BENCHMARK_MAIN();
