#include "plugin/cli/demo/demo.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "plugin/cli/demo/demo_run.h"
#include "plugin/cli/demo/launcher.h"

namespace stepguard {
namespace demo {

namespace {

// Without --policy the demo runs the shipped `default` preset, built into the library.
constexpr const char* kDefaultPreset = "default";

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

std::string rank_path(const std::string& path, const World& world) {
  if (path.empty() || world.rank == 0) return path;
  return path + ".rank" + std::to_string(world.rank);
}

}  // namespace

int run_demo(const DemoOptions& o) {
  const bool in_launched_world = std::getenv("WORLD_SIZE") != nullptr;
  if (o.ranks > 1 && !in_launched_world) return launch_ranks(o);
  DemoRun run(o);
  return run.run();
}

DemoRun::DemoRun(const DemoOptions& options)
    : o_(options), progress_(options.steps, options.log_every) {}

int DemoRun::run() {
  join_world();
  check_injection_ranks();
  set_threads();
  lead_ = world_.rank == 0;
  torch::manual_seed(static_cast<std::uint64_t>(o_.seed));  // identical replicas on every rank
  corpus_.emplace(Corpus::load(
      o_.corpus_dir, o_.stable_corpus ? stable_license_texts() : std::vector<std::string>{}));
  TORCH_CHECK(corpus_->size() > o_.context + 1, "demo: corpus is shorter than the context");
  build_model();
  build_guard();
  print_banner();
  resume();
  for (std::int64_t step = first_step_; step <= o_.steps; ++step) {
    if (!train_step(step)) break;
  }
  return finish();
}

void DemoRun::join_world() {
  if (std::getenv("WORLD_SIZE") == nullptr) return;
  Rendezvous rdv = rendezvous_from_env();
  rdv.timeout = std::chrono::seconds(o_.collective_timeout_s);
  if (o_.ranks != 1 && o_.ranks != rdv.world_size) {
    throw std::invalid_argument("--ranks " + std::to_string(o_.ranks) +
                                " disagrees with WORLD_SIZE=" + std::to_string(rdv.world_size));
  }
  world_.rank = rdv.rank;
  world_.local_rank = rdv.local_rank;
  world_.size = rdv.world_size;
  if (world_.size > 1) world_.group = init_gloo_process_group(rdv);
}

void DemoRun::check_injection_ranks() const {
  for (const auto& inj : o_.injections) {
    if (inj.rank >= world_.size) {
      throw std::invalid_argument(
          std::string("--inject ") + to_string(inj.kind) + "@" + std::to_string(inj.step) + ":" +
          std::to_string(inj.rank) + ": rank " + std::to_string(inj.rank) + " does not exist (" +
          std::to_string(world_.size) + " rank" + (world_.size > 1 ? "s" : "") + ")");
    }
  }
}

// --threads, else OMP_NUM_THREADS (as torch and torchrun read it), else: ranks sharing this
// machine's cores one thread each, one rank every CPU.
void DemoRun::set_threads() const {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const long from_env = omp != nullptr ? std::strtol(omp, nullptr, 10) : 0;
  if (o_.threads > 0) {
    torch::set_num_threads(o_.threads);
  } else if (from_env > 0 && from_env <= 1024) {
    torch::set_num_threads(static_cast<int>(from_env));
  } else if (world_.size > 1) {
    torch::set_num_threads(1);
  } else {
    // LibTorch's default counts physical cores; on a small VM that can be 1 of 2 CPUs.
    torch::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  }
}

void DemoRun::build_model() {
  mc_.vocab_size = corpus_->vocab_size();
  mc_.context = o_.context;
  model_ = CharTransformer(mc_);
  named_ = model_->named_parameters();
  params_ = model_->parameters();
  adamw_ = std::make_unique<torch::optim::AdamW>(
      params_, torch::optim::AdamWOptions(o_.lr).betas({0.9, 0.99}).weight_decay(0.01));
}

GuardOptions DemoRun::guard_options() const {
  GuardOptions guard_options =
      GuardOptions().trace_path(rank_path(o_.trace, world_)).incident_dir(o_.incident_dir);
  if (!o_.policy.empty()) {
    guard_options.policy(o_.policy);
  } else if (o_.max_consecutive_bad_steps >= 0) {
    // The built-in ladder with the asked limit.
    guard_options.max_consecutive_bad_steps(o_.max_consecutive_bad_steps);
  } else {
    guard_options.policy(kDefaultPreset);
  }
  // fp16 emulation: loss scaling on (a policy file's loss_scale section, if any, sets the numbers).
  if (o_.fp16) guard_options.loss_scaling(true);
  if (world_.size > 1) {
    guard_options.process_group(world_.group.group)
        .store(world_.group.store)
        .collective_timeout(std::chrono::milliseconds(o_.collective_timeout_s * 1000));
  }
  const std::string checkpoint_dir = !o_.checkpoint_dir.empty() ? o_.checkpoint_dir : o_.resume;
  if (!checkpoint_dir.empty()) {
    guard_options.checkpoint_dir(checkpoint_dir).checkpoint_every(o_.checkpoint_every);
  }
  if (o_.metrics_port >= 0) {
    guard_options.metrics_port(o_.metrics_port == 0 ? 0 : o_.metrics_port + world_.local_rank)
        .metrics_run_label(o_.run_name);
  }
  return guard_options;
}

void DemoRun::build_guard() {
  guard_ = std::make_unique<GuardedOptimizer>(*adamw_, named_, guard_options());
  GuardedOptimizer& guard = *guard_;
  guard.track_buffers(model_->named_buffers());
  if (o_.probe) {
    model_->set_probe([&guard](const std::string& name, const torch::Tensor& output) {
      return guard.probe(name, output);
    });
  }
}

void DemoRun::print_banner() const {
  if (!lead_) return;
  std::int64_t num_params = 0;
  for (const auto& p : params_) num_params += p.numel();
  std::fprintf(stderr,
               "stepguard demo: %zu license files, %" PRId64 " characters, vocab %" PRId64
               ", %" PRId64 " parameters, %" PRId64 " steps of %" PRId64 "x%" PRId64
               " tokens x %d rank%s\n",
               corpus_->num_files(), corpus_->size(), corpus_->vocab_size(), num_params, o_.steps,
               o_.batch_size, o_.context, world_.size, world_.size > 1 ? "s" : "");
  std::fprintf(stderr, "  %s\n", stepguard::build_info());
}

void DemoRun::resume() {
  if (o_.resume.empty()) return;
  GuardedOptimizer& guard = *guard_;
  const std::int64_t from = guard.resume(o_.resume);
  if (from > 0) {
    first_step_ = from + 1;
    batch_index_ = guard.stats().data_position;
  } else if (lead_) {
    progress_.note("no valid checkpoint in " + o_.resume + ": starting from step 1");
  }
}

bool DemoRun::train_step(std::int64_t step) {
  const auto t0 = Clock::now();
  step_ = step;
  load_batch();
  inject_weight_faults();
  const double saved_lr = adamw_->param_groups()[0].options().get_lr();
  const bool lr_spike = injected(FaultKind::kLrSpike);
  if (lr_spike) set_lr(saved_lr * 1000.0);
  poison_row_ = injected(FaultKind::kNanInput) ? 0 : -1;
  GuardedOptimizer& guard = *guard_;
  guard.set_replay([this](ReplayMode mode) {
    adamw_->zero_grad();
    auto loss = forward_backward(mode, false);
    inject_gradient_faults();  // deterministic faults come back; a transient one does not
    return loss;
  });

  adamw_->zero_grad();
  auto loss = forward_backward(ReplayMode::kAsIs, true);
  // Dies before the gradient average: the survivors fail in the loop's own collective.
  die_if_injected(FaultKind::kKillEarly);
  average_gradients_or_exit();
  inject_gradient_faults();
  inject_transient_fault();
  // Dies between the gradient average and the guard's collective: the survivors' guards must
  // notice within their deadline.
  die_if_injected(FaultKind::kKill);
  const StepReport report = guarded_step(loss);
  if (lr_spike) set_lr(saved_lr);
  return record_step(report, t0);
}

// Each rank reads its own slice of every global batch.
void DemoRun::load_batch() {
  const auto& tokens = corpus_->tokens();
  const auto offsets = corpus_->batch_offsets(o_.seed, batch_index_ * world_.size + world_.rank,
                                              o_.batch_size, o_.context);
  ++batch_index_;
  input_ = torch::empty({o_.batch_size, o_.context}, torch::kLong);
  target_ = torch::empty({o_.batch_size, o_.context}, torch::kLong);
  auto* in_ptr = input_.data_ptr<std::int64_t>();
  auto* tg_ptr = target_.data_ptr<std::int64_t>();
  for (std::int64_t b = 0; b < o_.batch_size; ++b) {
    for (std::int64_t t = 0; t < o_.context; ++t) {
      in_ptr[b * o_.context + t] = tokens[offsets[b] + t];
      tg_ptr[b * o_.context + t] = tokens[offsets[b] + t + 1];
    }
  }
}

void DemoRun::set_lr(double lr) {
  for (auto& g : adamw_->param_groups()) g.options().set_lr(lr);
}

// Forward and backward as this step does them; the guard's forensics replay calls it again
// (in fp32: no loss scaling and no fp16 storage of the gradients).
torch::Tensor DemoRun::forward_backward(ReplayMode mode, bool check_inputs) {
  GuardedOptimizer& guard = *guard_;
  const bool fp32 = mode == ReplayMode::kFp32;
  auto x = model_->embed(input_, poison_row_);
  if (check_inputs) guard.check_inputs({x});
  auto logits = model_->forward_embedded(x);
  auto loss =
      torch::nn::functional::cross_entropy(logits.view({-1, mc_.vocab_size}), target_.view({-1}));
  if (injected(FaultKind::kNanLoss)) loss = loss * std::nan("");
  if (injected(FaultKind::kLossSpike)) loss = loss * 1000.0;
  auto scaled = fp32 ? loss : guard.scale_loss(loss);
  // An fp16 overflow: the scaled gradients of this step exceed fp16's range (65504).
  if (injected(FaultKind::kOverflow)) scaled = scaled * 65536.0;
  scaled.backward();
  if (o_.fp16 && !fp32) {
    // Gradients stored in fp16 after the scaled backward, as in fp16 training: values beyond
    // 65504 become Inf, tiny ones flush. The guard unscales them in its inspection pass.
    torch::NoGradGuard no_grad;
    for (auto& p : params_) {
      if (p.grad().defined()) p.mutable_grad().copy_(p.grad().to(torch::kHalf));
    }
  }
  return loss;
}

void DemoRun::average_gradients_or_exit() {
  try {
    average_gradients(params_, world_, step_, o_.collective_timeout_s);
  } catch (const std::exception& e) {
    // The message names this rank, the step and the ranks that are gone.
    std::string cause = e.what();
    if (const auto nl = cause.find('\n'); nl != std::string::npos) cause.resize(nl);
    std::fprintf(stderr, "\n[rank %d] %s\n", world_.rank, cause.c_str());
    std::fflush(nullptr);
    std::_Exit(1);
  }
}

StepReport DemoRun::guarded_step(const torch::Tensor& loss) {
  GuardedOptimizer& guard = *guard_;
  try {
    return guard.step(loss);
  } catch (const std::runtime_error& e) {
    // The ranks can no longer agree. Leave at once: tearing down a process group whose peers
    // are gone can itself wait for their deadline.
    std::fprintf(stderr, "\n[rank %d] %s\n", world_.rank, e.what());
    std::fflush(nullptr);
    std::_Exit(1);
  }
}

// Returns false when the policy aborted training.
bool DemoRun::record_step(const StepReport& report, Clock::time_point started) {
  GuardedOptimizer& guard = *guard_;
  batch_index_ += report.batches_to_skip;
  const char* outcome = to_string(report.outcome);
  outcome_digest_ = fnv1a(outcome_digest_, outcome, std::strlen(outcome));

  if (report.applied()) {
    if (std::isnan(initial_loss_)) initial_loss_ = report.loss;
    applied_losses_.push_back(report.loss);
  }
  if (report.incident) record_incident(*report.incident);
  const double dt = std::chrono::duration<double>(Clock::now() - started).count();
  const double rate =
      static_cast<double>(o_.batch_size * o_.context * world_.size) / std::max(dt, 1e-9);
  tokens_per_s_ = tokens_per_s_ == 0.0 ? rate : 0.9 * tokens_per_s_ + 0.1 * rate;
  if (lead_) progress_.update(report, tokens_per_s_, guard);
  if (report.aborted()) {
    if (lead_) {
      progress_.note("stepguard aborted training at step " + std::to_string(report.step) + ": " +
                     report.incident.value_or(Incident{}).reason);
    }
    exit_status_ = 3;
    return false;
  }
  return true;
}

void DemoRun::record_incident(const Incident& inc) {
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
  incidents_.push_back(j);
  std::string blamed;
  for (std::size_t i = 0; i < inc.tensors.size() && i < 3; ++i) {
    blamed += (i ? ", " : "") + inc.tensors[i];
  }
  if (inc.tensors.size() > 3) blamed += ", ...";
  std::string ranks;
  for (int r : inc.ranks) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
  if (lead_) {
    progress_.note("  step " + std::to_string(inc.step) + ": " + to_string(inc.signal) + " -> " +
                   to_string(inc.action) + ", cause " + to_string(inc.cause) +
                   (blamed.empty() ? "" : " (" + blamed + ")") +
                   (world_.size > 1 ? " on rank " + ranks : ""));
  }
}

}  // namespace demo
}  // namespace stepguard
