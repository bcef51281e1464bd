#include "plugin/cli/demo/demo.h"

#include <signal.h>
#include <unistd.h>

#include <stepguard/stepguard.h>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "csrc/common/json_text.h"
#include "plugin/cli/demo/corpus.h"
#include "plugin/cli/demo/launcher.h"
#include "plugin/cli/demo/model.h"
#include "plugin/cli/demo/pictures.h"

namespace stepguard {
namespace demo {

namespace {

// Without --policy the demo runs the shipped `default` preset, built into the library.
constexpr const char* kDefaultPreset = "default";
constexpr const char* kDefaultPolicyName = "configs/policies/default.yaml (built in)";

using Clock = std::chrono::steady_clock;

// Parameters the gradient faults land in: one in attention, one in an MLP.
constexpr const char* kNanGradParam = "blocks.1.qkv.weight";
constexpr const char* kInfGradParam = "blocks.0.fc_in.weight";
constexpr const char* kCorruptParam = "blocks.0.proj.weight";

constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ull;

// Folds `n` bytes into the FNV-1a hash `h`.
std::uint64_t fnv1a(std::uint64_t h, const void* data, std::size_t n) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ bytes[i]) * 0x100000001b3ull;
  return h;
}

// FNV-1a over the bytes of every parameter, in order: equal hashes mean bitwise-equal models.
std::uint64_t hash_parameters(const std::vector<torch::Tensor>& params) {
  std::uint64_t h = kFnvOffset;
  for (const auto& p : params) {
    const auto c = p.detach().contiguous();
    h = fnv1a(h, c.data_ptr(), c.numel() * c.element_size());
  }
  return h;
}

std::string hex64(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, v);
  return buf;
}

nlohmann::json number_or_null(double v) {
  return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json();
}

// Whether `kind` hits `rank` at `step`; an injection without a rank hits every rank.
bool injected(const DemoOptions& o, FaultKind kind, std::int64_t step, int rank) {
  for (const auto& inj : o.injections) {
    if (inj.kind == kind && inj.step == step && (inj.rank < 0 || inj.rank == rank)) return true;
  }
  return false;
}

// Where this process stands in a multi-rank run.
struct World {
  int rank = 0;
  int local_rank = 0;
  int size = 1;
  ProcessGroupHandle group;  // empty for one rank
};

// Averages all gradients over the group in one flat all-reduce, as data-parallel training does.
void average_gradients(const std::vector<torch::Tensor>& params, const World& world,
                       std::int64_t step, std::int64_t timeout_s) {
  if (world.size == 1) return;
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad().view(-1));
  }
  std::vector<torch::Tensor> flat{torch::cat(grads)};
  // Named failures: a dead rank is named by the survivors, not left to a raw Gloo timeout.
  all_reduce_sum(world.group, flat, step, std::chrono::seconds(timeout_s), "gradient all-reduce");
  flat[0].div_(world.size);
  std::int64_t offset = 0;
  for (auto& g : grads) {
    g.copy_(flat[0].slice(0, offset, offset + g.numel()));
    offset += g.numel();
  }
}

// Every rank's value of `v`, in rank order (one all-gather, after training).
std::vector<std::uint64_t> gather_u64(std::uint64_t v, const World& world) {
  if (world.size == 1) return {v};
  std::vector<torch::Tensor> input{torch::tensor({static_cast<std::int64_t>(v)}, torch::kLong)};
  std::vector<std::vector<torch::Tensor>> output(1);
  for (int r = 0; r < world.size; ++r) output[0].push_back(torch::zeros({1}, torch::kLong));
  world.group.group->allgather(output, input)->wait();
  std::vector<std::uint64_t> values;
  for (const auto& t : output[0])
    values.push_back(static_cast<std::uint64_t>(t.item<std::int64_t>()));
  return values;
}

std::string rank_path(const std::string& path, const World& world) {
  if (path.empty() || world.rank == 0) return path;
  return path + ".rank" + std::to_string(world.rank);
}

torch::Tensor& grad_of(torch::OrderedDict<std::string, torch::Tensor>& named, const char* name) {
  auto* p = named.find(name);
  TORCH_CHECK(p != nullptr, "demo: no parameter named ", name);
  auto& g = p->mutable_grad();
  TORCH_CHECK(g.defined(), "demo: parameter ", name, " has no gradient");
  return g;
}

// Live progress: one rewritten line on a terminal, a plain line every N steps otherwise.
class Progress {
 public:
  Progress(std::int64_t total, std::int64_t log_every)
      : total_(total), tty_(isatty(STDERR_FILENO) == 1) {
    every_ = log_every > 0 ? log_every : std::max<std::int64_t>(1, total / 10);
  }
  void update(const StepReport& r, double tokens_per_s, std::int64_t skipped) {
    const bool last = r.step == total_;
    // The loss scale only matters (and is shown) under fp16 loss scaling.
    char scale[48] = "";
    if (r.loss_scale != 1.0) std::snprintf(scale, sizeof scale, "  scale %g", r.loss_scale);
    if (tty_) {
      const auto now = Clock::now();
      if (!last && now - last_draw_ < std::chrono::milliseconds(100)) return;
      last_draw_ = now;
      std::fprintf(stderr,
                   "\r\033[K  step %6" PRId64 "/%" PRId64
                   "  loss %7.4f  %8.0f tok/s  skipped %" PRId64 "%s",
                   r.step, total_, r.loss, tokens_per_s, skipped, scale);
      if (last) std::fputc('\n', stderr);
      std::fflush(stderr);
    } else if (r.step % every_ == 0 || last || r.step == 1) {
      std::fprintf(stderr,
                   "step %" PRId64 "/%" PRId64 " loss %.4f tok/s %.0f skipped %" PRId64 "%s\n",
                   r.step, total_, r.loss, tokens_per_s, skipped, scale);
    }
  }
  void note(const std::string& line) {
    if (tty_) std::fputs("\r\033[K", stderr);
    std::fprintf(stderr, "%s\n", line.c_str());
  }

 private:
  std::int64_t total_;
  bool tty_;
  std::int64_t every_ = 1;
  Clock::time_point last_draw_{};
};

}  // namespace

int run_demo(const DemoOptions& o) {
  const bool in_launched_world = std::getenv("WORLD_SIZE") != nullptr;
  if (o.ranks > 1 && !in_launched_world) return launch_ranks(o);

  World world;
  if (in_launched_world) {
    Rendezvous rdv = rendezvous_from_env();
    rdv.timeout = std::chrono::seconds(o.collective_timeout_s);
    if (o.ranks != 1 && o.ranks != rdv.world_size) {
      throw std::invalid_argument("--ranks " + std::to_string(o.ranks) +
                                  " disagrees with WORLD_SIZE=" + std::to_string(rdv.world_size));
    }
    world.rank = rdv.rank;
    world.local_rank = rdv.local_rank;
    world.size = rdv.world_size;
    if (world.size > 1) world.group = init_gloo_process_group(rdv);
  }
  for (const auto& inj : o.injections) {
    if (inj.rank >= world.size) {
      throw std::invalid_argument(
          std::string("--inject ") + to_string(inj.kind) + "@" + std::to_string(inj.step) + ":" +
          std::to_string(inj.rank) + ": rank " + std::to_string(inj.rank) + " does not exist (" +
          std::to_string(world.size) + " rank" + (world.size > 1 ? "s" : "") + ")");
    }
  }
  // Ranks sharing this machine's cores: one thread each unless told otherwise.
  if (o.threads > 0) {
    torch::set_num_threads(o.threads);
  } else if (world.size > 1) {
    torch::set_num_threads(1);
  } else {
    // LibTorch's default counts physical cores; on a small VM that can be 1 of 2 CPUs.
    torch::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  }
  const bool lead = world.rank == 0;
  torch::manual_seed(static_cast<std::uint64_t>(o.seed));  // identical replicas on every rank
  const Corpus corpus = Corpus::load(o.corpus_dir);
  TORCH_CHECK(corpus.size() > o.context + 1, "demo: corpus is shorter than the context");

  ModelConfig mc;
  mc.vocab_size = corpus.vocab_size();
  mc.context = o.context;
  CharTransformer model(mc);
  auto named = model->named_parameters();
  const auto params = model->parameters();
  torch::optim::AdamW adamw(params,
                            torch::optim::AdamWOptions(o.lr).betas({0.9, 0.99}).weight_decay(0.01));
  GuardOptions guard_options =
      GuardOptions().trace_path(rank_path(o.trace, world)).incident_dir(o.incident_dir);
  if (!o.policy.empty()) {
    guard_options.policy(o.policy);
  } else if (o.max_consecutive_bad_steps >= 0) {
    // The built-in ladder with the asked limit.
    guard_options.max_consecutive_bad_steps(o.max_consecutive_bad_steps);
  } else {
    guard_options.policy(kDefaultPreset);
  }
  // fp16 emulation: loss scaling on (a policy file's loss_scale section, if any, sets the numbers).
  if (o.fp16) guard_options.loss_scaling(true);
  if (world.size > 1) {
    guard_options.process_group(world.group.group)
        .store(world.group.store)
        .collective_timeout(std::chrono::milliseconds(o.collective_timeout_s * 1000));
  }
  const std::string checkpoint_dir = !o.checkpoint_dir.empty() ? o.checkpoint_dir : o.resume;
  if (!checkpoint_dir.empty()) {
    guard_options.checkpoint_dir(checkpoint_dir).checkpoint_every(o.checkpoint_every);
  }
  if (o.metrics_port >= 0) {
    guard_options.metrics_port(o.metrics_port == 0 ? 0 : o.metrics_port + world.local_rank)
        .run_name(o.run_name);
  }
  stepguard::GuardedOptimizer guard(adamw, named, guard_options);
  guard.track_buffers(model->named_buffers());
  if (o.probe) {
    model->set_probe([&guard](const std::string& name, const torch::Tensor& output) {
      return guard.probe(name, output);
    });
  }

  if (lead) {
    std::int64_t num_params = 0;
    for (const auto& p : params) num_params += p.numel();
    std::fprintf(stderr,
                 "stepguard demo: %zu license files, %" PRId64 " characters, vocab %" PRId64
                 ", %" PRId64 " parameters, %" PRId64 " steps of %" PRId64 "x%" PRId64
                 " tokens x %d rank%s\n",
                 corpus.num_files(), corpus.size(), corpus.vocab_size(), num_params, o.steps,
                 o.batch_size, o.context, world.size, world.size > 1 ? "s" : "");
    std::fprintf(stderr, "  %s\n", stepguard::build_info());
  }

  Progress progress(o.steps, o.log_every);
  std::vector<double> applied_losses;
  double initial_loss = std::numeric_limits<double>::quiet_NaN();
  nlohmann::json incidents = nlohmann::json::array();
  std::int64_t batch_index = 0;  // the data position: batches consumed (per rank)
  double tokens_per_s = 0.0;
  int exit_status = 0;
  std::uint64_t outcome_digest = kFnvOffset;  // FNV-1a over every step's outcome
  const auto& tokens = corpus.tokens();

  std::int64_t first_step = 1;
  if (!o.resume.empty()) {
    const std::int64_t from = guard.resume(o.resume);
    if (from > 0) {
      first_step = from + 1;
      batch_index = guard.data_position();
    } else if (lead) {
      progress.note("no valid checkpoint in " + o.resume + ": starting from step 1");
    }
  }
  for (std::int64_t step = first_step; step <= o.steps; ++step) {
    const auto t0 = Clock::now();
    // Each rank reads its own slice of every global batch.
    const auto offsets = corpus.batch_offsets(o.seed, batch_index * world.size + world.rank,
                                              o.batch_size, o.context);
    ++batch_index;
    auto input = torch::empty({o.batch_size, o.context}, torch::kLong);
    auto target = torch::empty({o.batch_size, o.context}, torch::kLong);
    auto* in_ptr = input.data_ptr<std::int64_t>();
    auto* tg_ptr = target.data_ptr<std::int64_t>();
    for (std::int64_t b = 0; b < o.batch_size; ++b) {
      for (std::int64_t t = 0; t < o.context; ++t) {
        in_ptr[b * o.context + t] = tokens[offsets[b] + t];
        tg_ptr[b * o.context + t] = tokens[offsets[b] + t + 1];
      }
    }

    if (injected(o, FaultKind::kCorruptWeights, step, world.rank)) {
      torch::NoGradGuard no_grad;
      named.find(kCorruptParam)->view(-1)[0].fill_(std::nan(""));
    }
    if (injected(o, FaultKind::kDriftWeights, step, world.rank)) {
      torch::NoGradGuard no_grad;
      named.find(kCorruptParam)->view(-1)[0].add_(0.5);  // finite: only a replica check sees it
    }
    const double saved_lr = adamw.param_groups()[0].options().get_lr();
    const bool lr_spike = injected(o, FaultKind::kLrSpike, step, world.rank);
    if (lr_spike) {
      for (auto& g : adamw.param_groups()) g.options().set_lr(saved_lr * 1000.0);
    }

    const std::int64_t poison_row = injected(o, FaultKind::kNanInput, step, world.rank) ? 0 : -1;
    // Forward and backward as this step does them; the guard's forensics replay calls it again
    // (in fp32: no loss scaling and no fp16 storage of the gradients).
    auto forward_backward = [&](ReplayMode mode, bool check_inputs) {
      const bool fp32 = mode == ReplayMode::kFp32;
      auto x = model->embed(input, poison_row);
      if (check_inputs) guard.check_inputs({x});
      auto logits = model->forward_embedded(x);
      auto loss =
          torch::nn::functional::cross_entropy(logits.view({-1, mc.vocab_size}), target.view({-1}));
      if (injected(o, FaultKind::kNanLoss, step, world.rank)) loss = loss * std::nan("");
      if (injected(o, FaultKind::kLossSpike, step, world.rank)) loss = loss * 1000.0;
      auto scaled = fp32 ? loss : guard.scale_loss(loss);
      // An fp16 overflow: the scaled gradients of this step exceed fp16's range (65504).
      if (injected(o, FaultKind::kOverflow, step, world.rank)) scaled = scaled * 65536.0;
      scaled.backward();
      if (o.fp16 && !fp32) {
        // Gradients stored in fp16 after the scaled backward, as in fp16 training: values beyond
        // 65504 become Inf, tiny ones flush. The guard unscales them in its inspection pass.
        torch::NoGradGuard no_grad;
        for (auto& p : params) {
          if (p.grad().defined()) p.mutable_grad().copy_(p.grad().to(torch::kHalf));
        }
      }
      return loss;
    };
    // Gradient faults land after the average: rank-local, as in a sharded optimizer or a bad GPU.
    auto inject_gradient_faults = [&] {
      if (injected(o, FaultKind::kNanGrad, step, world.rank)) {
        grad_of(named, kNanGradParam).view(-1)[7].fill_(std::nan(""));
      }
      if (injected(o, FaultKind::kInfGrad, step, world.rank)) {
        grad_of(named, kInfGradParam).view(-1)[3].fill_(std::numeric_limits<float>::infinity());
      }
    };
    guard.set_replay([&](ReplayMode mode) {
      adamw.zero_grad();
      auto loss = forward_backward(mode, false);
      inject_gradient_faults();  // deterministic faults come back; a transient one does not
      return loss;
    });

    adamw.zero_grad();
    auto loss = forward_backward(ReplayMode::kAsIs, true);
    if (injected(o, FaultKind::kKillEarly, step, world.rank)) {
      // Dies before the gradient average: the survivors fail in the loop's own collective.
      progress.note("[rank " + std::to_string(world.rank) + "] injected kill_early at step " +
                    std::to_string(step));
      std::fflush(nullptr);
      raise(SIGKILL);
    }
    try {
      average_gradients(params, world, step, o.collective_timeout_s);
    } catch (const std::exception& e) {
      // The message names this rank, the step and the ranks that are gone.
      std::string cause = e.what();
      if (const auto nl = cause.find('\n'); nl != std::string::npos) cause.resize(nl);
      std::fprintf(stderr, "\n[rank %d] %s\n", world.rank, cause.c_str());
      std::fflush(nullptr);
      std::_Exit(1);
    }
    inject_gradient_faults();
    if (injected(o, FaultKind::kTransientNan, step, world.rank)) {
      // A silent corruption in this execution only: replaying the batch comes out clean.
      grad_of(named, kNanGradParam).view(-1)[11].fill_(std::nan(""));
    }

    if (injected(o, FaultKind::kKill, step, world.rank)) {
      // Dies between the gradient average and the guard's collective: the survivors' guards
      // must notice within their deadline.
      progress.note("[rank " + std::to_string(world.rank) + "] injected kill at step " +
                    std::to_string(step));
      std::fflush(nullptr);
      raise(SIGKILL);
    }
    StepReport report;
    try {
      report = guard.step(loss);
    } catch (const std::runtime_error& e) {
      // The ranks can no longer agree. Leave at once: tearing down a process group whose peers
      // are gone can itself wait for their deadline.
      std::fprintf(stderr, "\n[rank %d] %s\n", world.rank, e.what());
      std::fflush(nullptr);
      std::_Exit(1);
    }
    if (lr_spike) {
      for (auto& g : adamw.param_groups()) g.options().set_lr(saved_lr);
    }
    batch_index += report.batches_to_skip;
    const char* outcome = to_string(report.outcome);
    outcome_digest = fnv1a(outcome_digest, outcome, std::strlen(outcome));

    if (report.applied()) {
      if (std::isnan(initial_loss)) initial_loss = report.loss;
      applied_losses.push_back(report.loss);
    }
    if (report.incident) {
      const auto& inc = *report.incident;
      nlohmann::json j = {{"step", inc.step},
                          {"signal", to_string(inc.signal)},
                          {"action", to_string(inc.action)},
                          {"cause", to_string(inc.cause)},
                          {"tensors", inc.tensors},
                          {"ranks", inc.ranks},
                          {"reason", inc.reason},
                          {"evidence", inc.evidence},
                          {"fixes", inc.fixes}};
      nlohmann::json rank_causes = nlohmann::json::object();
      for (const RankCause& c : inc.rank_causes) {
        rank_causes[std::to_string(c.rank)] = to_string(c.cause);
      }
      j["rank_causes"] = rank_causes;
      if (!inc.report.empty()) j["report"] = inc.report;
      incidents.push_back(j);
      std::string blamed;
      for (std::size_t i = 0; i < inc.tensors.size() && i < 3; ++i) {
        blamed += (i ? ", " : "") + inc.tensors[i];
      }
      if (inc.tensors.size() > 3) blamed += ", ...";
      std::string ranks;
      for (int r : inc.ranks) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
      if (lead) {
        progress.note("  step " + std::to_string(inc.step) + ": " + to_string(inc.signal) + " -> " +
                      to_string(inc.action) + ", cause " + to_string(inc.cause) +
                      (blamed.empty() ? "" : " (" + blamed + ")") +
                      (world.size > 1 ? " on rank " + ranks : ""));
      }
    }
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    const double rate =
        static_cast<double>(o.batch_size * o.context * world.size) / std::max(dt, 1e-9);
    tokens_per_s = tokens_per_s == 0.0 ? rate : 0.9 * tokens_per_s + 0.1 * rate;
    if (lead) progress.update(report, tokens_per_s, guard.totals().skipped);
    if (report.aborted()) {
      if (lead) {
        progress.note("stepguard aborted training at step " + std::to_string(report.step) + ": " +
                      report.incident.value_or(Incident{}).reason);
      }
      exit_status = 3;
      break;
    }
  }

  guard.set_replay({});  // it refers to the loop's locals
  model->set_probe({});  // so does the probe

  // Summary. Hashes and outcome digests come from every rank: equal values mean the replicas
  // stayed bitwise identical and decided identically on every step.
  const GuardTotals totals = guard.totals();
  const std::size_t tail = std::min<std::size_t>(10, applied_losses.size());
  double final_loss = std::numeric_limits<double>::quiet_NaN();
  if (tail > 0) {
    double sum = 0.0;
    for (std::size_t i = applied_losses.size() - tail; i < applied_losses.size(); ++i) {
      sum += applied_losses[i];
    }
    final_loss = sum / static_cast<double>(tail);
  }
  bool params_finite = true;
  for (const auto& p : params)
    params_finite = params_finite && torch::isfinite(p).all().item<bool>();
  if (o.linger_s > 0 && o.metrics_port >= 0) {
    if (lead) {
      std::fprintf(stderr, "serving metrics for %" PRId64 " more seconds\n", o.linger_s);
    }
    std::this_thread::sleep_for(std::chrono::seconds(o.linger_s));
  }
  const auto hashes = gather_u64(hash_parameters(params), world);
  const auto outcome_digests = gather_u64(outcome_digest, world);
  const auto finite_flags = gather_u64(params_finite ? 1 : 0, world);
  // Every rank has finished its last step (the gathers above are collectives): a run that ended
  // well makes its last checkpoint visible.
  if (exit_status == 0) guard.commit_pending_checkpoint();
  if (!lead) return exit_status;

  nlohmann::json param_hashes = nlohmann::json::array();
  bool hashes_equal = true, outcomes_agree = true;
  for (std::size_t r = 0; r < hashes.size(); ++r) {
    param_hashes.push_back(hex64(hashes[r]));
    hashes_equal = hashes_equal && hashes[r] == hashes[0];
    outcomes_agree = outcomes_agree && outcome_digests[r] == outcome_digests[0];
    params_finite = params_finite && finite_flags[r] == 1;
  }
  const std::string pictures =
      draw_incident_pictures(o.incident_dir.empty() ? "" : o.trace, incidents);
  nlohmann::json summary = {
      {"steps", totals.steps},
      {"applied", totals.applied},
      {"skipped", totals.skipped},
      {"rollbacks", totals.rolled_back},
      {"aborted", totals.aborted > 0},
      {"initial_loss", number_or_null(initial_loss)},
      {"final_loss", number_or_null(final_loss)},
      {"params_finite", params_finite},
      {"param_hashes", param_hashes},
      {"outcomes_agree", outcomes_agree},
      {"loss_scale", guard.loss_scale()},
      {"precision", o.fp16 ? "fp16" : "fp32"},
      {"lr_factor", guard.lr_factor()},
      {"policy", o.policy.empty()
                     ? (o.max_consecutive_bad_steps >= 0 ? "built-in ladder" : kDefaultPolicyName)
                     : o.policy},
      {"ranks", world.size},
      {"seed", o.seed},
      {"collectives", guard.collectives()},
      {"step_buffer_bytes", guard.step_buffer_bytes()},
      {"batches_consumed", batch_index},
      {"checkpoints", guard.checkpoints_written()},
      {"resumed_from", first_step - 1},
      {"incidents", incidents},
  };
  if (!o.summary_json.empty()) {
    std::ofstream out(o.summary_json);
    out << dump_json(summary, 2) << '\n';
    if (!out) throw std::runtime_error("demo: cannot write summary to '" + o.summary_json + "'");
  }

  std::ostringstream table;
  table << "\nstepguard demo summary\n";
  char line[256];
  auto row = [&](const char* key, const std::string& value) {
    std::snprintf(line, sizeof line, "  %-16s %s\n", key, value.c_str());
    table << line;
  };
  row("steps", std::to_string(totals.steps) + " of " + std::to_string(o.steps));
  row("applied", std::to_string(totals.applied));
  row("skipped", std::to_string(totals.skipped));
  if (totals.rolled_back > 0 || totals.snapshots > 0) {
    row("rollbacks", std::to_string(totals.rolled_back) + " (" + std::to_string(totals.snapshots) +
                         " RAM snapshots taken)");
  }
  if (guard.lr_factor() != 1.0) {
    std::snprintf(line, sizeof line, "%g", guard.lr_factor());
    row("lr factor", line);
  }
  row("aborted", totals.aborted > 0 ? "yes" : "no");
  std::snprintf(line, sizeof line, "%.4f -> %.4f (%+.1f%%)", initial_loss, final_loss,
                100.0 * (final_loss / initial_loss - 1.0));
  row("loss", line);
  row("params finite", params_finite ? "yes" : "NO");
  if (o.fp16) {
    std::snprintf(line, sizeof line, "%g (fp16 emulation)", guard.loss_scale());
    row("loss scale", line);
  }
  if (world.size == 1) {
    row("param hash", param_hashes[0].get<std::string>());
  } else {
    row("ranks", std::to_string(world.size) +
                     (hashes_equal ? ", parameters bitwise equal" : ", PARAMETERS DIFFER") +
                     (outcomes_agree ? ", same decision every step" : ", DECISIONS DIFFER"));
  }
  row("collectives",
      std::to_string(guard.collectives()) +
          (world.size > 1 ? " (one per step, two more per incident step)" : " (one per step)") +
          ", step buffer " + std::to_string(guard.step_buffer_bytes()) + " bytes");
  if (!incidents.empty()) {
    table << "  incidents\n";
    std::snprintf(line, sizeof line, "    %-6s %-16s %-15s %-18s %-6s %s\n", "step", "signal",
                  "action", "cause", "ranks", "tensors");
    table << line;
    for (const auto& inc : incidents) {
      std::string tensors, ranks;
      for (std::size_t i = 0; i < inc["tensors"].size() && i < 2; ++i) {
        tensors += (i ? "," : "") + inc["tensors"][i].get<std::string>();
      }
      if (inc["tensors"].size() > 2) {
        tensors += " (+" + std::to_string(inc["tensors"].size() - 2) + " more)";
      }
      // Each origin rank with the cause it found, when the ranks agreed on causes.
      for (const auto& r : inc["ranks"]) {
        const std::string key = std::to_string(r.get<int>());
        ranks += (ranks.empty() ? "" : ",") + key;
        if (world.size > 1 && inc["rank_causes"].contains(key)) {
          ranks += ":" + inc["rank_causes"][key].get<std::string>();
        }
      }
      std::snprintf(line, sizeof line, "    %-6" PRId64 " %-16s %-15s %-18s %-6s %s\n",
                    inc["step"].get<std::int64_t>(), inc["signal"].get<std::string>().c_str(),
                    inc["action"].get<std::string>().c_str(),
                    inc["cause"].get<std::string>().c_str(), ranks.c_str(), tensors.c_str());
      table << line;
    }
  }
  if (!pictures.empty()) row("pictures", pictures);
  if (!o.summary_json.empty()) row("summary json", o.summary_json);
  if (!o.trace.empty()) row("trace", o.trace + (world.size > 1 ? " (+ .rank<r> per rank)" : ""));
  std::cout << table.str() << std::flush;
  return exit_status;
}

}  // namespace demo
}  // namespace stepguard
