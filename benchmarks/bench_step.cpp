// A guarded C++ training iteration against the same iteration unguarded, in one process.
//
//   build/bin/bench_step [--rounds R] [--block B] [--large-block B] [--large-batch N] [--only TEXT]
//                        [--threads T] [--per-iteration] [--device cpu|cuda[:N]]
//
// Models: the demo's character transformer (plugin/cli/demo/model.h, its default dimensions,
// batch 32 x 64 tokens) and the same class at d_model 768, 8 blocks, 12 heads (57M parameters,
// batch N x 128 tokens, N = 4 by default: 1.4 s an iteration on 2 cores; the guard's work grows
// with the parameters, not the tokens, so a smaller batch shows a larger overhead); batches are
// windows of the demo's corpus, as the demo reads them. With --device cuda the model, its
// gradients and the batches live on the GPU and every timed span ends with a device synchronize
// (benchmarks/gpu_check.sh runs it so on a GPU machine).
// Policies: configs/policies/default.yaml (RAM snapshots every 50 steps, 2 kept; the optimizer
// state checked every step), the same with the state check never due (detectors.optimizer_state
// every 10^9 steps: the check's cost is the difference in inspect_ms and step_overhead, in one
// run), and the spike detectors and rules without snapshots (rollbacks become skips).
//
// One model and one AdamW over its parameters: "plain" calls adamw.step(), "guarded" calls
// guard.step(loss) on a GuardedOptimizer around that same AdamW; both then adamw.zero_grad(). So
// the two iterations differ in the step call only, not in where the optimizer state lives. A
// timed iteration is forward, backward, step and zero_grad. After two untimed iterations of each,
// R rounds alternate a block of B plain iterations with a block of B guarded ones (B: --block for
// the demo model, --large-block for the large one).
//
// Snapshots are counted in proportion: with the default policy R x B must be a multiple of 50,
// so the timed guarded iterations hold exactly R x B / 50 snapshot steps. Before timing, untimed
// guarded iterations run past steps 50 and 100, so both ring slots exist and every timed snapshot
// refills one as in a long run (only a run's first two allocate theirs), and on to where each
// snapshot step falls in the middle of a guarded block, so the next iteration, which the
// snapshot's background copy overlaps, is a guarded one too.
//
// One JSON object per case: plain_ms and guarded_ms are median iterations, overhead = guarded /
// plain - 1 from them (a median leaves out the snapshot steps); overhead_mean from means.
// snapshot_extra_ms is what one snapshot adds to the guarded iterations it touches (its step and
// the next, beyond the median), and overhead_snapshots = (guarded_ms + snapshot_extra_ms x
// snapshots / iterations) / plain_ms - 1: the overhead with snapshots in proportion, from
// medians. plain_step_ms and guard_step_ms are the mean times of the two step calls alone, and
// step_overhead = (guard_step_ms - plain_step_ms) / plain_ms: the guard's cost per iteration
// measured at the call (its training-thread time: not a background copy's); plain_rest_ms and
// guarded_rest_ms are the medians of the rest of each iteration (forward, backward, zero_grad),
// which the guard leaves alone but a background copy slows down. The stage split
// (GuardedOptimizer::last_stage_seconds) gives means per guarded step: inspect_ms, agree_ms,
// decide_ms, act_ms (holds AdamW's own step), snapshot_ms (starting the copy and waiting for it,
// over all steps), record_ms.
#include <malloc.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "plugin/cli/demo/corpus.h"
#include "plugin/cli/demo/model.h"
#include "stepguard/stepguard.h"

namespace {

using Clock = std::chrono::steady_clock;
using stepguard::demo::CharTransformer;
using stepguard::demo::Corpus;
using stepguard::demo::ModelConfig;

// configs/policies/default.yaml's snapshot cadence and ring size.
constexpr std::int64_t kSnapshotEvery = 50;
constexpr std::int64_t kSnapshotKeep = 2;

// default.yaml's detectors and rules with no RAM snapshots: its rollbacks become skips.
constexpr const char* kNoSnapshotsPolicy = R"(version: 1
detectors:
  loss_spike: {z: 6, warmup: 100, decay: 0.99, early_factor: 10}
  grad_norm_spike: {z: 6, warmup: 100, decay: 0.99, early_factor: 30}
rules:
  - {name: skip-nonfinite, on: nonfinite, action: skip_batch}
  - {name: cool-down-lr, on: nonfinite, consecutive: 3, action: lower_lr, factor: 0.5,
     floor: 0.05, recover_after: 50, recover_over: 500}
  - {name: skip-loss-spike, on: loss_spike, action: skip_batch}
  - {name: clip-grad-norm-spike, on: grad_norm_spike, action: clip}
limits:
  max_consecutive_bad_steps: 50
  max_skips: {count: 100, within: 1000, action: abort}
)";

struct Args {
  int rounds = 5;
  int block = 50;
  int large_block = 10;
  int large_batch = 4;
  int threads = 0;             // 0: every CPU, as the demo runs
  bool per_iteration = false;  // every timed iteration on stderr, to see where time went
  std::string device = "cpu";
  std::string only;
  std::string corpus = "/usr/share/common-licenses";
};

struct Case {
  const char* name;
  ModelConfig model;
  std::int64_t batch;
  bool snapshots;  // default.yaml, else kNoSnapshotsPolicy
  int block;
  bool state_check = true;  // default.yaml's optimizer_state check every step, else never due
};

struct Batch {
  torch::Tensor input, target;
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double mean(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

// The demo's batches: windows of the corpus, input and next-character target.
std::vector<Batch> make_batches(const Corpus& corpus, std::int64_t count, std::int64_t batch,
                                std::int64_t context) {
  std::vector<Batch> out;
  const auto& tokens = corpus.tokens();
  for (std::int64_t i = 0; i < count; ++i) {
    const auto offsets = corpus.batch_offsets(1234, i, batch, context);
    Batch b{torch::empty({batch, context}, torch::kLong),
            torch::empty({batch, context}, torch::kLong)};
    auto* in = b.input.data_ptr<std::int64_t>();
    auto* tg = b.target.data_ptr<std::int64_t>();
    for (std::int64_t r = 0; r < batch; ++r) {
      for (std::int64_t t = 0; t < context; ++t) {
        in[r * context + t] = tokens[offsets[r] + t];
        tg[r * context + t] = tokens[offsets[r] + t + 1];
      }
    }
    out.push_back(std::move(b));
  }
  return out;
}

// What one case measured: the timed iterations and what the guard did during them.
struct Measured {
  std::vector<double> plain_times, guarded_times, plain_steps, guard_steps;
  std::vector<stepguard::StageSeconds> stages;
  std::vector<std::size_t> snapshot_steps;  // indices into guarded_times
  double case_seconds = 0.0;
  std::int64_t snapshots = 0;  // during the timed iterations
  std::int64_t applied = 0;    // during the timed iterations
  std::int64_t incidents = 0;  // in all
};

// One case's training loop: its model, the AdamW over it, the guard around that AdamW and the
// batches (on the case's device). Not thread-safe.
struct CaseLoop {
  const Case& c;
  CharTransformer& model;
  torch::optim::AdamW& adamw;
  stepguard::GuardedOptimizer& guard;
  const std::vector<Batch>& batches;
  torch::Device device;
  std::int64_t next_batch = 0;
  std::int64_t guard_step = 0;  // the guard's number of the last guarded iteration's step

  // Ends a timed span: on a GPU the host runs ahead of the kernels it queued.
  void sync() const {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  }

  // One iteration; `guarded` picks the step. Returns its seconds and the step call's.
  double iteration(bool guarded, double* step_seconds) {
    const Batch& b = batches[static_cast<std::size_t>(next_batch++ % 16)];
    const auto t0 = Clock::now();
    auto logits = model->forward(b.input);
    auto loss = torch::nn::functional::cross_entropy(logits.view({-1, c.model.vocab_size}),
                                                     b.target.view({-1}));
    loss.backward();
    sync();
    const auto t_step = Clock::now();
    if (guarded) {
      guard_step = guard.step(loss.detach()).step;
    } else {
      adamw.step();
    }
    sync();
    *step_seconds = seconds_since(t_step);
    adamw.zero_grad();
    sync();
    return seconds_since(t0);
  }

  // Untimed iterations of each kind; with snapshots, on until the ring is filled and every
  // snapshot step falls in the middle of a guarded block.
  void warm_up() {
    double ignored = 0.0;
    for (int i = 0; i < 2; ++i) {
      iteration(false, &ignored);
      iteration(true, &ignored);
    }
    if (c.snapshots) {
      // Untimed guarded iterations up to the second snapshot step, as in a long run.
      while (guard.stats().step_count < kSnapshotKeep * kSnapshotEvery) iteration(true, &ignored);
      TORCH_CHECK(guard.stats().snapshots_held == kSnapshotKeep,
                  "bench_step: the snapshot ring was not filled before timing");
      // Snapshot steps in mid-block: the iteration after each, which the copy overlaps, is guarded.
      const std::int64_t start =
          (kSnapshotKeep + 1) * kSnapshotEvery - (c.block / 2) % kSnapshotEvery;
      while (guard.stats().step_count < start) iteration(true, &ignored);
    }
  }

  // `rounds` rounds of a plain block and a guarded block.
  void time_rounds(int rounds, bool per_iteration, Measured* m) {
    const auto t_case = Clock::now();
    for (int r = 0; r < rounds; ++r) {
      for (const bool guarded : {false, true}) {
        for (int i = 0; i < c.block; ++i) {
          double step_seconds = 0.0;
          const double seconds = iteration(guarded, &step_seconds);
          (guarded ? m->guard_steps : m->plain_steps).push_back(step_seconds);
          if (per_iteration) {
            std::fprintf(stderr, "%s round %d %s %d: %.3f ms, step %.3f ms\n", c.name, r,
                         guarded ? "guarded" : "plain", i, 1e3 * seconds, 1e3 * step_seconds);
          }
          if (!guarded) {
            m->plain_times.push_back(seconds);
            continue;
          }
          if (c.snapshots && guard_step % kSnapshotEvery == 0) {
            m->snapshot_steps.push_back(m->guarded_times.size());
          }
          m->guarded_times.push_back(seconds);
          m->stages.push_back(guard.stats().last_step_seconds);
        }
      }
    }
    m->case_seconds = seconds_since(t_case);
  }
};

// What a snapshot adds to the iterations it touches: its step, and the next one, which its
// background copy overlaps; beyond the median guarded iteration, per snapshot.
double snapshot_extra_ms(const Measured& m, double guarded_ms) {
  double extra_ms = 0.0;
  for (const std::size_t j : m.snapshot_steps) {
    for (std::size_t k = j; k < std::min(j + 2, m.guarded_times.size()); ++k) {
      extra_ms += 1e3 * m.guarded_times[k] - guarded_ms;
    }
  }
  if (!m.snapshot_steps.empty()) extra_ms /= static_cast<double>(m.snapshot_steps.size());
  return extra_ms;
}

// The case's JSON line (the fields are described at the top of this file).
void print_case(const Case& c, const Args& args, std::int64_t num_params, std::int64_t timed,
                const Measured& m) {
  auto stage_ms = [&](double stepguard::StageSeconds::*field) {
    double sum = 0.0;
    for (const auto& s : m.stages) sum += s.*field;
    return 1e3 * sum / static_cast<double>(m.stages.size());
  };
  const double plain_ms = 1e3 * median(m.plain_times);
  const double guarded_ms = 1e3 * median(m.guarded_times);
  const double plain_mean_ms = 1e3 * mean(m.plain_times);
  const double guarded_mean_ms = 1e3 * mean(m.guarded_times);
  const double plain_step_ms = 1e3 * mean(m.plain_steps);
  const double guard_step_ms = 1e3 * mean(m.guard_steps);
  // The rest of an iteration (forward, backward, zero_grad), which the guard should not change.
  auto rest_ms = [](const std::vector<double>& iterations, const std::vector<double>& steps) {
    std::vector<double> rest;
    for (std::size_t i = 0; i < iterations.size(); ++i) rest.push_back(iterations[i] - steps[i]);
    return 1e3 * median(rest);
  };
  const double snapshot_ms = stage_ms(&stepguard::StageSeconds::snapshot);
  const double extra_ms = snapshot_extra_ms(m, guarded_ms);
  const double guarded_with_snapshots_ms =
      guarded_ms +
      extra_ms * static_cast<double>(m.snapshot_steps.size()) / static_cast<double>(timed);
  std::printf(
      "{\"case\": \"%s\", \"device\": \"%s\", \"params\": %" PRId64
      ", \"threads\": %d, \"iterations\": %" PRId64
      ", \"plain_ms\": %.3f, \"guarded_ms\": %.3f, \"overhead\": %.4f, \"plain_mean_ms\": %.3f, "
      "\"guarded_mean_ms\": %.3f, \"overhead_mean\": %.4f, \"plain_step_ms\": %.3f, "
      "\"guard_step_ms\": %.3f, \"step_overhead\": %.4f, \"plain_rest_ms\": %.3f, "
      "\"guarded_rest_ms\": %.3f, \"inspect_ms\": %.3f, \"agree_ms\": %.3f, "
      "\"decide_ms\": %.3f, \"act_ms\": %.3f, \"snapshot_ms\": %.3f, \"record_ms\": %.3f, "
      "\"snapshots\": %" PRId64
      ", \"snapshot_extra_ms\": %.3f, \"overhead_snapshots\": %.4f, "
      "\"applied\": %" PRId64 ", \"incidents\": %" PRId64 ", \"seconds\": %.1f}\n",
      c.name, args.device.c_str(), num_params, torch::get_num_threads(), timed, plain_ms,
      guarded_ms, guarded_ms / plain_ms - 1.0, plain_mean_ms, guarded_mean_ms,
      guarded_mean_ms / plain_mean_ms - 1.0, plain_step_ms, guard_step_ms,
      (guard_step_ms - plain_step_ms) / plain_ms, rest_ms(m.plain_times, m.plain_steps),
      rest_ms(m.guarded_times, m.guard_steps), stage_ms(&stepguard::StageSeconds::inspect),
      stage_ms(&stepguard::StageSeconds::agree), stage_ms(&stepguard::StageSeconds::decide),
      stage_ms(&stepguard::StageSeconds::act), snapshot_ms,
      stage_ms(&stepguard::StageSeconds::record), m.snapshots, extra_ms,
      guarded_with_snapshots_ms / plain_ms - 1.0, m.applied, m.incidents, m.case_seconds);
}

void run_case(const Case& c, const Corpus& corpus, const Args& args) {
  const int rounds = args.rounds;
  const std::int64_t timed = static_cast<std::int64_t>(rounds) * c.block;
  TORCH_CHECK(!c.snapshots || timed % kSnapshotEvery == 0, "bench_step: ", c.name,
              ": rounds x block (", timed, ") must be a multiple of ", kSnapshotEvery,
              " to count snapshots in proportion");
  torch::manual_seed(0);
  const torch::Device device(args.device);
  CharTransformer model(c.model);
  model->to(device);
  const auto params = model->parameters();
  std::int64_t num_params = 0;
  for (const auto& p : params) num_params += p.numel();
  const auto adamw_options = torch::optim::AdamWOptions(3e-4).betas({0.9, 0.99}).weight_decay(0.01);
  torch::optim::AdamW adamw(params, adamw_options);
  stepguard::GuardOptions options;
  if (c.snapshots && c.state_check) {
    options.policy("default");  // the shipped preset, built in
  } else if (c.snapshots) {
    std::string yaml = stepguard::policy_preset_text("default");
    const std::string every = "optimizer_state: {every: 1}";
    const std::size_t at = yaml.find(every);
    TORCH_CHECK(at != std::string::npos, "bench_step: the default preset has no '", every, "'");
    options.policy_yaml(yaml.replace(at, every.size(), "optimizer_state: {every: 1000000000}"));
  } else {
    options.policy_yaml(kNoSnapshotsPolicy);
  }
  stepguard::GuardedOptimizer guard(adamw, model->named_parameters(), options);
  std::vector<Batch> batches = make_batches(corpus, 16, c.batch, c.model.context);
  for (Batch& b : batches) b = {b.input.to(device), b.target.to(device)};

  CaseLoop loop{c, model, adamw, guard, batches, device};
  loop.warm_up();
  const std::int64_t snapshots_before = guard.stats().totals.snapshots;
  const std::int64_t applied_before = guard.stats().totals.applied;
  Measured m;
  loop.time_rounds(rounds, args.per_iteration, &m);
  m.snapshots = guard.stats().totals.snapshots - snapshots_before;
  m.applied = guard.stats().totals.applied - applied_before;
  m.incidents = guard.stats().totals.incidents;
  print_case(c, args, num_params, timed, m);
  std::fflush(stdout);
}

int parse_int(const char* flag, const char* value) {
  char* end = nullptr;
  const long v = value ? std::strtol(value, &end, 10) : 0;
  if (!value || *end != '\0' || v < 0 || v > 100000) {
    std::fprintf(stderr, "bench_step: %s needs a count, got '%s'\n", flag, value ? value : "");
    std::exit(2);
  }
  return static_cast<int>(v);
}

// The command line into `args`; false (usage printed) when it is not understood.
bool parse_args(int argc, char** argv, Args* args) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : nullptr;
    if (flag == "--rounds") {
      args->rounds = parse_int("--rounds", value);
    } else if (flag == "--block") {
      args->block = parse_int("--block", value);
    } else if (flag == "--large-block") {
      args->large_block = parse_int("--large-block", value);
    } else if (flag == "--large-batch") {
      args->large_batch = parse_int("--large-batch", value);
    } else if (flag == "--threads") {
      args->threads = parse_int("--threads", value);
    } else if (flag == "--per-iteration") {
      args->per_iteration = true;
      continue;
    } else if (flag == "--only" && value) {
      args->only = value;
    } else if (flag == "--device" && value) {
      args->device = value;
    } else if (flag == "--corpus" && value) {
      args->corpus = value;
    } else {
      std::fprintf(stderr,
                   "usage: bench_step [--rounds R] [--block B] [--large-block B] [--large-batch N] "
                   "[--only TEXT] [--threads T] [--corpus DIR] [--per-iteration] "
                   "[--device cpu|cuda[:N]]\n");
      return false;
    }
    ++i;
  }
  return true;
}

// Whether --device names a device this run can measure; false (said why) otherwise.
bool usable_device(const std::string& name) {
  try {
    const torch::Device device(name);
    if (device.is_cuda() && !torch::cuda::is_available()) {
      std::fprintf(stderr, "bench_step: --device %s: no CUDA device is available\n", name.c_str());
      return false;
    }
    if (!device.is_cpu() && !device.is_cuda()) {
      std::fprintf(stderr, "bench_step: --device %s: only cpu and cuda are measured\n",
                   name.c_str());
      return false;
    }
  } catch (const std::exception&) {
    std::fprintf(stderr, "bench_step: --device '%s' is not a device (cpu, cuda, cuda:N)\n",
                 name.c_str());
    return false;
  }
  return true;
}

// The cases that --only selects, each run in turn; 1 (said why) when one fails.
int run_cases(const Args& args) {
  const Corpus corpus = Corpus::load(args.corpus);

  ModelConfig demo;  // the demo's own dimensions
  demo.vocab_size = corpus.vocab_size();
  ModelConfig large = demo;
  large.d_model = 768;
  large.heads = 12;
  large.layers = 8;
  large.context = 128;
  const Case cases[] = {
      {"demo/default_policy", demo, 32, true, args.block},
      {"demo/no_state_check", demo, 32, true, args.block, false},
      {"demo/no_snapshots", demo, 32, false, args.block},
      {"57M/default_policy", large, args.large_batch, true, args.large_block},
      {"57M/no_state_check", large, args.large_batch, true, args.large_block, false},
      {"57M/no_snapshots", large, args.large_batch, false, args.large_block},
  };
  try {
    for (const Case& c : cases) {
      if (!args.only.empty() && std::string(c.name).find(args.only) == std::string::npos) continue;
      run_case(c, corpus, args);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_step: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Steady host memory for both loops. By default glibc maps blocks above a moving threshold fresh
  // and returns free memory above another to the OS, so AdamW's per-step temporaries (up to 9 MB
  // each here) fault their pages in again on some steps and not on others: with the 1.4 GB
  // snapshot ring resident, plain AdamW steps of the 57M model took either about 90 ms or 700-900
  // ms (this VM faults memory in at about 5 s per GB), in the plain and the guarded loop alike.
  // Fixed thresholds keep those blocks in the heap, as a GPU job's caching allocator does.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest: half of a thread arena's heap
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  Args args;
  if (!parse_args(argc, argv, &args)) return 2;
  if (args.rounds < 1 || args.block < 1 || args.large_block < 1 || args.large_batch < 1) {
    std::fprintf(stderr,
                 "bench_step: --rounds, --block, --large-block and --large-batch must be >= 1\n");
    return 2;
  }
  torch::set_num_threads(args.threads > 0
                             ? args.threads
                             : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  if (!usable_device(args.device)) return 2;
  return run_cases(args);
}
