// GuardedOptimizer: wires the engine modules together for one guarded step. Nothing else.
#include "stepguard/guarded_optimizer.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/serialize.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>

#include "csrc/checkpoint/disk_checkpoint.h"
#include "csrc/checkpoint/payload.h"
#include "csrc/checkpoint/snapshot.h"
#include "csrc/consensus/consensus.h"
#include "csrc/consensus/nccl_probe.h"
#include "csrc/consensus/process_group_consensus.h"
#include "csrc/forensics/classifier.h"
#include "csrc/forensics/report.h"
#include "csrc/inspect/cuda/inspect_cuda.h"
#include "csrc/inspect/inspect.h"
#include "csrc/policy/policy.h"
#include "csrc/policy/policy_file.h"
#include "csrc/telemetry/event_log.h"
#include "csrc/telemetry/metrics.h"
#include "plugin/src/step_controller.h"
#include "stepguard/version.h"

namespace stepguard {

namespace {

// Fills the slots after inspection's four: the loss, this rank's fault flag and state digest.
// Tensor ops on the buffer's device, so nothing is read back to the host before the collective.
void fill_step_buffer(at::Tensor& buffer, const at::Tensor& loss, std::uint64_t digest, int rank,
                      int world_size) {
  const at::Tensor l = loss.detach().reshape({}).to(buffer.options());
  const at::Tensor finite = at::isfinite(l);
  buffer.select(0, stats_slot::kLossSum).copy_(at::where(finite, l, at::zeros_like(l)));
  buffer.select(0, stats_slot::kLossNonfinite).copy_(finite.logical_not());
  buffer.select(0, stats_slot::kRanksReporting).fill_(1.0);
  const at::Tensor bad = buffer.select(0, stats_slot::kNanCount) +
                         buffer.select(0, stats_slot::kInfCount) +
                         buffer.select(0, stats_slot::kLossNonfinite);
  buffer.select(0, stats_slot::rank_fault(rank)).copy_(bad > 0);
  buffer.select(0, stats_slot::rank_digest(world_size, rank)).fill_(static_cast<double>(digest));
}

GlobalStats unpack_global_stats(const at::Tensor& buffer, int world_size, std::int64_t step,
                                bool sharded_gradients) {
  const at::Tensor host = buffer.to(at::kCPU);
  const double* s = host.data_ptr<double>();
  TORCH_CHECK(static_cast<int>(s[stats_slot::kRanksReporting]) == world_size, "stepguard: step ",
              step, ": ", s[stats_slot::kRanksReporting], " of ", world_size,
              " ranks reported statistics; the consensus buffer is inconsistent");
  GlobalStats g;
  g.world_size = world_size;
  g.nan_count = static_cast<std::int64_t>(s[stats_slot::kNanCount]);
  g.inf_count = static_cast<std::int64_t>(s[stats_slot::kInfCount]);
  g.sum_squares_overflow = s[stats_slot::kSumSquaresOverflow] > 0.0;
  // Replicated gradients (data parallel) count once: the mean over ranks of identical sums.
  const double sum_squares =
      sharded_gradients ? s[stats_slot::kSumSquares] : s[stats_slot::kSumSquares] / world_size;
  g.sum_squares = g.sum_squares_overflow ? std::numeric_limits<double>::infinity() : sum_squares;
  g.grad_norm = std::sqrt(g.sum_squares);
  g.loss_nonfinite_ranks = static_cast<std::int64_t>(s[stats_slot::kLossNonfinite]);
  const std::int64_t finite_ranks = world_size - g.loss_nonfinite_ranks;
  g.loss = finite_ranks > 0 ? s[stats_slot::kLossSum] / static_cast<double>(finite_ranks)
                            : std::numeric_limits<double>::quiet_NaN();
  for (int r = 0; r < world_size; ++r) {
    if (s[stats_slot::rank_fault(r)] > 0.0) g.faulty_ranks.push_back(r);
  }
  // The majority digest is the agreed state; ties go to the lower rank's digest. Every rank sees
  // the same buffer, so every rank names the same outliers.
  std::map<double, int> votes;
  for (int r = 0; r < world_size; ++r) ++votes[s[stats_slot::rank_digest(world_size, r)]];
  double majority = s[stats_slot::rank_digest(world_size, 0)];
  for (int r = 0; r < world_size; ++r) {
    const double d = s[stats_slot::rank_digest(world_size, r)];
    if (votes[d] > votes[majority]) majority = d;
  }
  for (int r = 0; r < world_size; ++r) {
    if (s[stats_slot::rank_digest(world_size, r)] != majority) g.desynced_ranks.push_back(r);
  }
  return g;
}

std::unique_ptr<consensus::Consensus> make_consensus(const GuardOptions& options) {
  TORCH_CHECK(options.collective_timeout_ms() > 0,
              "stepguard: collective_timeout_ms must be positive, got ",
              options.collective_timeout_ms());
  if (!options.process_group()) {
    TORCH_CHECK(!options.store(), "stepguard: a store was given without a process group");
    return std::make_unique<consensus::LocalConsensus>();
  }
  return std::make_unique<consensus::ProcessGroupConsensus>(
      options.process_group(), std::chrono::milliseconds(options.collective_timeout_ms()),
      options.store());
}

policy::PolicyConfig policy_config_of(const GuardOptions& options) {
  TORCH_CHECK(options.max_consecutive_bad_steps() >= 0,
              "stepguard: max_consecutive_bad_steps must be >= 0, got ",
              options.max_consecutive_bad_steps());
  TORCH_CHECK(options.policy_file().empty() || options.policy_yaml().empty(),
              "stepguard: both policy_file ('", options.policy_file(),
              "') and policy_yaml are set; set one");
  if (options.policy_file().empty() && options.policy_yaml().empty()) {
    policy::PolicyConfig config;
    config.limits.max_consecutive_bad_steps = options.max_consecutive_bad_steps();
    return config;
  }
  const std::string where = options.policy_file().empty()
                                ? std::string("policy_yaml")
                                : "the policy file '" + options.policy_file() + "'";
  TORCH_CHECK(options.max_consecutive_bad_steps() == 0,
              "stepguard: max_consecutive_bad_steps is set both in GuardOptions and through ",
              where, "; set it in one place");
  if (!options.policy_file().empty()) return policy::load_policy_file(options.policy_file());
  policy::PolicyConfig config;
  auto issues = policy::parse_policy(options.policy_yaml(), "policy_yaml", &config);
  if (!issues.empty()) throw policy::PolicyFileError(std::move(issues));
  return config;
}

StepController make_controller(const GuardOptions& options) {
  try {
    return StepController(policy_config_of(options), options.loss_scaling());
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
}

// The strongest action of a decision names the incident.
Action strongest(const std::vector<Action>& actions) {
  constexpr Action kByStrength[] = {Action::kAbort,         Action::kRollback,  Action::kLowerLr,
                                    Action::kDropLossScale, Action::kSkipBatch, Action::kClip,
                                    Action::kAlert};
  for (Action a : kByStrength) {
    if (std::find(actions.begin(), actions.end(), a) != actions.end()) return a;
  }
  return Action::kApply;
}

}  // namespace

struct GuardedOptimizer::Impl {
  Impl(torch::optim::Optimizer& opt, GuardOptions opts)
      : optimizer(opt),
        options(std::move(opts)),
        consensus(make_consensus(options)),
        controller(make_controller(options)) {
    const policy::CheckpointCadence& cadence = controller.config().checkpoint;
    TORCH_CHECK(options.checkpoint_every() >= 0, "stepguard: checkpoint_every must be >= 0, got ",
                options.checkpoint_every());
    disk_every = options.checkpoint_every() > 0 ? options.checkpoint_every() : cadence.disk_every;
    disk_keep = static_cast<int>(cadence.disk_keep);
    TORCH_CHECK(options.checkpoint_dir().empty() || disk_every > 0, "stepguard: checkpoint_dir '",
                options.checkpoint_dir(),
                "' is set but no cadence: set checkpoint_every or the policy's "
                "checkpoint.disk_every");
    TORCH_CHECK(
        !options.checkpoint_dir().empty() || disk_every == 0 || options.checkpoint_every() == 0,
        "stepguard: checkpoint_every is set but checkpoint_dir is empty");
    if (options.checkpoint_dir().empty()) disk_every = 0;
    if (cadence.snapshot_every > 0) {
      snapshots = std::make_unique<checkpoint::SnapshotRing>(
          static_cast<std::size_t>(cadence.snapshot_keep));
    }
    TORCH_CHECK(options.max_blamed_tensors() >= 0, "stepguard: max_blamed_tensors must be >= 0");
    collect_parameters(torch::OrderedDict<std::string, torch::Tensor>());
    TORCH_CHECK(options.metrics_port() >= -1 && options.metrics_port() <= 65535,
                "stepguard: metrics_port must be -1 (off), 0 (any free port) or a TCP port, got ",
                options.metrics_port());
#if !defined(STEPGUARD_WITH_METRICS)
    TORCH_CHECK(options.metrics_port() < 0,
                "stepguard: metrics_port is set but this build has no metrics "
                "(configured with STEPGUARD_WITH_METRICS=OFF)");
#else
    if (options.metrics_port() >= 0) {
      telemetry::MetricsConfig mc;
      mc.bind_address = options.metrics_bind_address();
      mc.port = options.metrics_port();
      mc.run = options.run_name();
      mc.rank = consensus->rank();
      mc.loss_scale_min = controller.loss_scale_floor();
      const int nccl = consensus::nccl_version();
      mc.build_labels = {{"version", version()},
                         {"libtorch", TORCH_VERSION},
                         {"cuda", cuda::compiled_with_cuda() ? "yes" : "no"},
                         {"nccl", nccl ? std::to_string(nccl) : "none"}};
      metrics = std::make_unique<telemetry::Metrics>(mc);
      // Say where, once: with port 0 nobody else knows.
      std::fprintf(stderr, "stepguard: serving metrics at http://%s/metrics (run %s, rank %d)\n",
                   metrics->endpoint().c_str(), mc.run.c_str(), mc.rank);
    }
#endif
    if (!options.trace_path().empty()) {
      event_log =
          std::make_unique<telemetry::EventLog>(options.trace_path(), options.trace_every_step());
    }
  }

  void collect_parameters(const torch::OrderedDict<std::string, torch::Tensor>& named) {
    std::unordered_map<const c10::TensorImpl*, std::string> name_of;
    for (const auto& item : named) name_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
    params.clear();
    names.clear();
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        auto it = name_of.find(p.unsafeGetTensorImpl());
        names.push_back(it != name_of.end() ? it->second
                                            : "param_" + std::to_string(params.size()));
        params.push_back(p);
      }
    }
  }

  std::size_t optimizer_param_count() const {
    std::size_t n = 0;
    for (const auto& group : optimizer.param_groups()) n += group.params().size();
    return n;
  }

  void validate_loss(const torch::Tensor& loss) const {
    TORCH_CHECK(loss.defined(), "stepguard: step(loss) got an undefined loss tensor");
    TORCH_CHECK(loss.numel() == 1, "stepguard: loss must be a scalar (one element), got shape ",
                loss.sizes());
    TORCH_CHECK(at::isFloatingType(loss.scalar_type()),
                "stepguard: loss must be a floating-point tensor, got ", loss.scalar_type());
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& g = params[i].grad();
      if (!g.defined()) continue;
      TORCH_CHECK(g.device() == loss.device(), "stepguard: loss is on ", loss.device(),
                  " but the gradient of '", names[i], "' is on ", g.device(),
                  "; loss and gradients must be on one device");
      break;
    }
  }

  void zero_grads() {
    at::NoGradGuard no_grad;
    for (auto& p : params) {
      auto& g = p.mutable_grad();
      if (g.defined()) g.zero_();
    }
  }

  GuardState state() const {
    GuardState g;
    g.step = step;
    g.words = controller.encode();
    g.consecutive_bad_steps = controller.engine_state().consecutive_bad_steps;
    g.bad_steps_total = controller.engine_state().bad_steps_total;
    g.loss_scale = controller.loss_scale();
    g.lr_factor = controller.lr_factor();
    return g;
  }

  // Every rank's `value`, through one sum all-reduce (rare: rollback and resume only).
  std::vector<std::int64_t> gather(std::int64_t value, std::int64_t tag) {
    const int world = consensus->world_size();
    if (world == 1) return {value};
    const at::Device device = params.empty() ? at::Device(at::kCPU) : params[0].device();
    at::Tensor buffer = at::zeros({world}, at::TensorOptions().dtype(at::kDouble).device(device));
    buffer.select(0, consensus->rank()).fill_(static_cast<double>(value));
    consensus->all_reduce_sum(buffer, tag);
    const at::Tensor host = buffer.to(at::kCPU);
    std::vector<std::int64_t> out;
    for (int r = 0; r < world; ++r)
      out.push_back(static_cast<std::int64_t>(host[r].item<double>()));
    return out;
  }
  std::int64_t agree_min(std::int64_t value, std::int64_t tag) {
    const auto all = gather(value, tag);
    return *std::min_element(all.begin(), all.end());
  }

  std::vector<std::int64_t> totals_words() const {
    return {totals.steps,   totals.applied,   totals.skipped,   totals.rolled_back,
            totals.aborted, totals.incidents, totals.snapshots, checkpoints_written};
  }

  checkpoint::GuardRecord record(std::int64_t at_step) const {
    checkpoint::GuardRecord r;
    r.step = at_step;
    r.data_position = data_position;
    r.guard = controller.encode();
    r.totals = totals_words();
    for (const auto& [first, count] : skipped_ranges) {
      r.skipped_ranges.push_back(first);
      r.skipped_ranges.push_back(count);
    }
    return r;
  }

  // Replays the offending batch once in `mode`; whether it came out non-finite. Anomaly mode's
  // error names the op that made the first NaN in backward.
  forensics::ReplayResult replay_once(ReplayMode mode, forensics::Evidence* ev) {
    if (!forward_rng.empty()) set_rng_state(forward_rng);  // the original forward's randomness
    for (auto& p : params) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    bool bad = false;
    try {
      torch::Tensor loss;
      if (mode == ReplayMode::kAnomaly) {
        torch::autograd::DetectAnomalyGuard anomaly;
        loss = replay(mode);
      } else {
        loss = replay(mode);
      }
      bad = !loss.defined() || !at::isfinite(loss.detach()).all().item<bool>();
    } catch (const std::exception& e) {
      // Anomaly mode reports the first backward function that returned NaN by throwing.
      const std::string what = e.what();
      const std::string first_line = what.substr(0, what.find('\n'));
      const auto at = what.find("Function '");
      if (mode != ReplayMode::kAnomaly || at == std::string::npos) {
        ev->anomaly_message = "the replay closure failed: " + first_line;
        return forensics::ReplayResult::kNotRun;
      }
      const auto end = what.find('\'', at + 10);
      ev->anomaly_op = what.substr(at + 10, end == std::string::npos ? end : end - at - 10);
      ev->anomaly_message = first_line;
      return forensics::ReplayResult::kReproduced;
    }
    for (const auto& p : params) {
      const auto& g = p.grad();
      if (g.defined() && !at::isfinite(g).all().item<bool>()) bad = true;
    }
    return bad ? forensics::ReplayResult::kReproduced : forensics::ReplayResult::kVanished;
  }

  // What this rank can tell about an incident, replays included.
  forensics::Evidence gather_evidence(const GlobalStats& g, const Signals& signals,
                                      const std::vector<std::string>& blamed) {
    forensics::Evidence ev;
    ev.loss_nonfinite = g.loss_nonfinite_ranks > 0;
    ev.grads_nonfinite = g.nonfinite_count() > 0;
    ev.nan_count = g.nan_count;
    ev.inf_count = g.inf_count;
    ev.loss_spike = signals.has(Signal::kLossSpike) || signals.has(Signal::kLossRatio);
    ev.grad_norm_spike = signals.has(Signal::kGradNormSpike);
    ev.bad_inputs = bad_inputs;
    ev.blamed_grads = blamed;
    ev.loss_scaling = controller.loss_scaling();
    ev.loss_scale = step_loss_scale;
    ev.grad_norm = g.grad_norm;
    ev.loss = g.loss;
    for (const auto& h : history) {
      ev.recent_grad_norms.push_back(h.grad_norm);
      ev.recent_losses.push_back(h.loss);
    }
    {
      at::NoGradGuard no_grad;
      for (std::size_t i = 0; i < params.size(); ++i) {
        if (!at::isfinite(params[i]).all().item<bool>()) ev.nonfinite_params.push_back(names[i]);
      }
    }
    for (const auto& p : *probes) {
      if (ev.first_bad_forward.empty() && !p.forward_finite) ev.first_bad_forward = p.name;
    }
    int first_backward = -1;
    for (const auto& p : *probes) {
      if (!p.grad_finite && p.backward_order >= 0 &&
          (first_backward < 0 || p.backward_order < first_backward)) {
        first_backward = p.backward_order;
        ev.first_bad_backward = p.name;
      }
    }
    // Replays cost a few forward/backward passes: once per streak of bad steps, at its start.
    if (replay && (ev.loss_nonfinite || ev.grads_nonfinite) && signals.consecutive_bad_steps <= 1) {
      replaying = true;
      // Replays must not move the training's random streams.
      const std::vector<at::Tensor> training_rng = rng_state();
      replay_scale = step_loss_scale;  // "as is": the scale of the step, not the backed-off one
      ev.rerun = replay_once(ReplayMode::kAsIs, &ev);
      if (ev.rerun == forensics::ReplayResult::kReproduced && controller.loss_scaling()) {
        ev.fp32 = replay_once(ReplayMode::kFp32, &ev);
      }
      if (ev.rerun == forensics::ReplayResult::kReproduced) {
        (void)replay_once(ReplayMode::kAnomaly, &ev);
      }
      replay_scale.reset();
      replaying = false;
      set_rng_state(training_rng);
    }
    return ev;
  }

  // Writes the JSON and Markdown report (and the checked batch); returns the JSON's path.
  std::string write_incident_report(std::int64_t at_step, nlohmann::json& r) {
    namespace fs = std::filesystem;
    const std::string& dir = options.incident_dir();
    char name[64];
    std::snprintf(name, sizeof name, "incident-step-%09" PRId64, at_step);
    const std::string prefix =
        dir + "/" +
        (consensus->world_size() > 1 ? "rank-" + std::to_string(consensus->rank()) + "-"
                                     : std::string()) +
        name;
    try {
      fs::create_directories(dir);
      if (!checked_inputs.empty()) {
        std::vector<torch::Tensor> host;
        for (const auto& t : checked_inputs) host.push_back(t.to(at::kCPU));
        torch::save(host, prefix + ".batch.pt");
        r["batch"] = prefix + ".batch.pt";
      }
      checkpoint::write_file_atomically(prefix + ".json", r.dump(2) + "\n");
      checkpoint::write_file_atomically(prefix + ".md", forensics::render_markdown(r));
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "stepguard: step %" PRId64 ": cannot write the incident report to %s: %s\n",
                   at_step, dir.c_str(), e.what());
      return {};
    }
    return prefix + ".json";
  }

  // Scales every gradient by one factor so the global norm becomes `target` (ZClip-style: the
  // target comes from the grad-norm EMA, agreed on every rank).
  void clip_gradients(double grad_norm, double target) {
    if (!(grad_norm > target) || !(target > 0)) return;
    at::NoGradGuard no_grad;
    const double coef = target / grad_norm;
    for (auto& p : params) {
      auto& g = p.mutable_grad();
      if (g.defined()) g.mul_(coef);
    }
  }

  // The optimizer step with the LR factor applied to every param group for its duration only, so
  // the loop's own lr values and schedulers are untouched.
  void optimizer_step(double lr_factor) {
    if (lr_factor == 1.0) {
      optimizer.step();
      return;
    }
    std::vector<double> saved;
    for (auto& group : optimizer.param_groups()) {
      saved.push_back(group.options().get_lr());
      group.options().set_lr(saved.back() * lr_factor);
    }
    try {
      optimizer.step();
    } catch (...) {
      restore_lrs(saved);
      throw;
    }
    restore_lrs(saved);
  }

  void restore_lrs(const std::vector<double>& saved) {
    std::size_t i = 0;
    for (auto& group : optimizer.param_groups()) group.options().set_lr(saved[i++]);
  }

  torch::optim::Optimizer& optimizer;
  GuardOptions options;
  std::unique_ptr<consensus::Consensus> consensus;
  StepController controller;
  std::unique_ptr<checkpoint::SnapshotRing> snapshots;
  std::int64_t disk_every = 0;
  int disk_keep = 3;
  std::int64_t pending_disk_step = 0;  // written, waiting for the next step's confirmation
  double pending_disk_seconds = 0.0;
  std::int64_t checkpoints_written = 0;
  std::int64_t data_position = 0;
  std::vector<std::pair<std::int64_t, std::int64_t>> skipped_ranges;
  std::vector<torch::Tensor> buffers;  // module buffers snapshots and checkpoints also hold
  // Forensics.
  std::function<torch::Tensor(ReplayMode)> replay;
  std::vector<std::string> bad_inputs;        // from this step's check_inputs()
  std::vector<torch::Tensor> checked_inputs;  // saved with an incident report
  struct HistoryRow {
    std::int64_t step;
    double loss, grad_norm, loss_scale, lr_factor;
    std::string outcome;
  };
  std::deque<HistoryRow> history;  // the last kHistory steps, oldest first
  double step_loss_scale = 1.0;    // the scale this step's backward used
  struct ProbeRecord {
    std::string name;
    bool forward_finite = true;
    int backward_order = -1;  // when its gradient arrived, among the probes; -1 = not yet
    bool grad_finite = true;
  };
  std::shared_ptr<std::vector<ProbeRecord>> probes = std::make_shared<std::vector<ProbeRecord>>();
  std::shared_ptr<int> probe_grads_seen = std::make_shared<int>(0);
  bool replaying = false;
  // The random streams as they were before this step's forward pass (captured after the previous
  // step and again by check_inputs()), so a replay draws the same dropout masks as the original.
  std::vector<at::Tensor> forward_rng;

  static std::vector<at::Generator> generators() {
    std::vector<at::Generator> gens = {at::detail::getDefaultCPUGenerator()};
    if (at::detail::getCUDAHooks().hasCUDA()) {
      for (int d = 0; d < at::detail::getCUDAHooks().getNumGPUs(); ++d) {
        gens.push_back(at::globalContext().defaultGenerator(at::Device(at::kCUDA, d)));
      }
    }
    return gens;
  }
  static std::vector<at::Tensor> rng_state() {
    std::vector<at::Tensor> states;
    for (auto& gen : generators()) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      states.push_back(gen.get_state());
    }
    return states;
  }
  static void set_rng_state(const std::vector<at::Tensor>& states) {
    auto gens = generators();
    for (std::size_t i = 0; i < gens.size() && i < states.size(); ++i) {
      std::lock_guard<std::mutex> lock(gens[i].mutex());
      gens[i].set_state(states[i]);
    }
  }
  std::optional<double> replay_scale;  // while replaying: scale_loss() uses the step's scale
  static constexpr std::size_t kHistory = 16;

  // What snapshots and checkpoints hold: the parameters, then the tracked buffers.
  std::vector<torch::Tensor> state_tensors() const {
    std::vector<torch::Tensor> all = params;
    all.insert(all.end(), buffers.begin(), buffers.end());
    return all;
  }
  std::unique_ptr<telemetry::EventLog> event_log;
  std::unique_ptr<telemetry::Metrics> metrics;
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  std::int64_t step = 0;
  GuardTotals totals;
  bool aborted = false;
  std::string abort_reason;
};

GuardedOptimizer::GuardedOptimizer(torch::optim::Optimizer& optimizer, GuardOptions options)
    : impl_(std::make_unique<Impl>(optimizer, std::move(options))) {}

GuardedOptimizer::GuardedOptimizer(
    torch::optim::Optimizer& optimizer,
    const torch::OrderedDict<std::string, torch::Tensor>& named_parameters, GuardOptions options)
    : impl_(std::make_unique<Impl>(optimizer, std::move(options))) {
  impl_->collect_parameters(named_parameters);
}

GuardedOptimizer::~GuardedOptimizer() = default;

StepReport GuardedOptimizer::step(const torch::Tensor& loss) {
  Impl& s = *impl_;
  TORCH_CHECK(!s.aborted, "stepguard: training was aborted at step ", s.step, " (", s.abort_reason,
              "); step() refuses to run after an abort");
  if (s.optimizer_param_count() != s.params.size())
    s.collect_parameters(torch::OrderedDict<std::string, torch::Tensor>());
  s.validate_loss(loss);

  // 1 inspect. Validation inside inspection throws before anything changes.
  std::vector<at::Tensor> grads;
  grads.reserve(s.params.size());
  for (const auto& p : s.params) grads.push_back(p.grad());
  using Clock = std::chrono::steady_clock;
  const auto t_inspect = Clock::now();
  inspect::InspectOptions inspect_options;
  if (s.controller.loss_scaling()) {
    // The fused pass unscales in place: the optimizer then sees true gradients.
    inspect_options.inv_scale = s.controller.inv_loss_scale();
    inspect_options.unscale_in_place = true;
  }
  // The step's one buffer, on the gradients' device: inspection writes its first four slots.
  at::Tensor buffer = at::zeros({stats_slot::size(s.consensus->world_size())},
                                at::TensorOptions().dtype(at::kDouble).device(loss.device()));
  LocalStats local;
  inspect::DeferredBlame deferred_blame;
  inspect::inspect_into(grads, inspect_options, buffer.narrow(0, 0, 4), &local, &deferred_blame);
  const double inspect_seconds = std::chrono::duration<double>(Clock::now() - t_inspect).count();
  const std::uint64_t digest = s.controller.digest(s.step);
  const std::int64_t step = ++s.step;
  ++s.data_position;  // this step's batch
  fill_step_buffer(buffer, loss, digest, s.consensus->rank(), s.consensus->world_size());

  // 2 agree: the one collective of the step, then its one read to the host.
  const auto t_consensus = Clock::now();
  try {
    s.consensus->all_reduce_sum(buffer, step);
  } catch (const std::exception& e) {
    // The ranks can no longer agree: nothing may be applied from here on.
    s.aborted = true;
    s.abort_reason = e.what();
    throw;
  }
  const GlobalStats global =
      unpack_global_stats(buffer, s.consensus->world_size(), step, s.options.sharded_gradients());
  const double consensus_seconds =
      std::chrono::duration<double>(Clock::now() - t_consensus).count();

  // 3 detect, 4 decide: the same on every rank (a function of the agreed stats and state).
  s.step_loss_scale = s.controller.loss_scale();
  const StepDecision decided = s.controller.decide(step, global);
  const Signals& signals = decided.signals;
  Decision decision = decided.decision;
  std::string reason = decision.reason;

  // Per-tensor results left on the device are read only when this rank has something to blame.
  if (deferred_blame.pending() && std::find(global.faulty_ranks.begin(), global.faulty_ranks.end(),
                                            s.consensus->rank()) != global.faulty_ranks.end()) {
    deferred_blame.fetch(&local);
  }
  // Blame in backward order: the last layers' gradients are computed first.
  std::vector<std::string> blamed;
  for (auto it = local.nonfinite_tensors.rbegin(); it != local.nonfinite_tensors.rend(); ++it) {
    if (static_cast<std::int64_t>(blamed.size()) >= s.options.max_blamed_tensors()) break;
    blamed.push_back(s.names[static_cast<std::size_t>(*it)]);
  }
  // Forensics before acting: the replays need the pre-step state.
  forensics::Evidence evidence;
  forensics::Diagnosis diagnosis;
  if (signals.any()) {
    evidence = s.gather_evidence(global, signals, blamed);
    diagnosis = forensics::classify(evidence);
  }

  // 5 act. The snapshot taken after the previous step is confirmed by a clean step, dropped
  // otherwise (the update that produced it is the suspect).
  if (s.snapshots) s.snapshots->on_step(step, !signals.any());
  std::int64_t rolled_back_to = 0;
  if (decision.outcome == Outcome::kRolledBack) {
    std::vector<std::string> dropped;
    const bool had_any = s.snapshots && s.snapshots->newest_confirmed() != nullptr;
    const checkpoint::Snapshot* mine = s.snapshots ? s.snapshots->newest_valid(&dropped) : nullptr;
    for (const auto& line : dropped) {
      std::fprintf(stderr, "stepguard: step %" PRId64 ": %s\n", step, line.c_str());
    }
    if (had_any && mine == nullptr) {
      s.aborted = true;
      s.abort_reason = "every RAM snapshot failed its checksum; nothing is left to roll back to";
    }
    // Every rank must restore the same step: the newest one all of them hold.
    const std::int64_t agreed = s.agree_min(mine ? mine->step : 0, step);
    const checkpoint::Snapshot* target =
        agreed > 0 && s.snapshots ? s.snapshots->confirmed_at(agreed) : nullptr;
    if (s.aborted) {
      TORCH_CHECK(false, "stepguard: step ", step, ": cannot roll back: ", s.abort_reason);
    }
    if (agreed > 0 && target == nullptr) {
      s.aborted = true;
      s.abort_reason = "rank " + std::to_string(s.consensus->rank()) +
                       " holds no snapshot of step " + std::to_string(agreed) +
                       ", the newest every rank holds";
      TORCH_CHECK(false, "stepguard: step ", step, ": cannot roll back: ", s.abort_reason);
    }
    if (target != nullptr) {
      rolled_back_to = target->step;
      const std::vector<std::int64_t> words = target->guard;
      s.snapshots->restore(*target, s.state_tensors(), s.optimizer);  // drops newer snapshots
      try {
        s.controller.rollback_to(words, decision);
      } catch (const std::invalid_argument& e) {
        TORCH_CHECK(false, "stepguard: step ", step, ": rollback to step ", rolled_back_to, ": ",
                    e.what());
      }
      reason += " (rolled back to step " + std::to_string(rolled_back_to) + ")";
    } else {
      // Nothing confirmed to go back to yet: the batch is skipped and the loop is still told how
      // many batches to drop.
      decision.outcome = Outcome::kSkipped;
      decision.actions.erase(
          std::remove(decision.actions.begin(), decision.actions.end(), Action::kRollback),
          decision.actions.end());
      decision.actions.insert(decision.actions.begin(), Action::kSkipBatch);
      reason += " (no confirmed snapshot to roll back to yet: skipped instead)";
    }
  }
  switch (decision.outcome) {
    case Outcome::kApplied:
      if (decision.has(Action::kClip)) s.clip_gradients(global.grad_norm, decision.clip_norm);
      s.optimizer_step(decided.lr_factor);
      ++s.totals.applied;
      break;
    case Outcome::kSkipped:
      if (s.options.zero_grad_on_skip()) s.zero_grads();
      ++s.totals.skipped;
      break;
    case Outcome::kRolledBack:
      s.zero_grads();  // gradients of the abandoned state
      ++s.totals.rolled_back;
      break;
    case Outcome::kAborted:
      if (s.options.zero_grad_on_skip()) s.zero_grads();
      s.aborted = true;
      s.abort_reason = reason;
      ++s.totals.aborted;
      break;
  }
  ++s.totals.steps;
  if (decision.batches_to_skip > 0) {
    s.skipped_ranges.push_back({s.data_position, decision.batches_to_skip});
    s.data_position += decision.batches_to_skip;
  }
  // The disk checkpoint written after the previous step becomes visible only if this step is
  // clean; rank 0 writes the manifest (every rank finished that step before this collective).
  if (s.pending_disk_step > 0) {
    const bool confirm = s.pending_disk_step == step - 1 && !signals.any();
    if (s.consensus->rank() == 0) {
      if (confirm) {
        checkpoint::commit_checkpoint(s.options.checkpoint_dir(), s.pending_disk_step,
                                      s.consensus->world_size(), s.disk_keep);
      } else {
        checkpoint::discard_checkpoint(s.options.checkpoint_dir(), s.pending_disk_step);
      }
    }
    if (confirm) {
      ++s.checkpoints_written;
      if (s.metrics) s.metrics->record_checkpoint(s.pending_disk_step, s.pending_disk_seconds);
    }
    s.pending_disk_step = 0;
  }
  const std::int64_t every = s.controller.config().checkpoint.snapshot_every;
  if (s.snapshots && decision.outcome == Outcome::kApplied && step % every == 0) {
    s.snapshots->take(step, s.state_tensors(), s.optimizer, s.controller.encode());
    ++s.totals.snapshots;
    if (s.metrics) s.metrics->record_snapshot(s.snapshots->bytes());
  }
  if (s.disk_every > 0 && decision.outcome == Outcome::kApplied && step % s.disk_every == 0) {
    const auto t_write = Clock::now();
    const checkpoint::EncodedPayload payload =
        checkpoint::encode_payload(s.record(step), s.state_tensors(), s.optimizer);
    checkpoint::write_rank_file(s.options.checkpoint_dir(), step, s.consensus->rank(),
                                payload.pieces());
    s.pending_disk_seconds = std::chrono::duration<double>(Clock::now() - t_write).count();
    s.pending_disk_step = step;
  }

  // 6 record.
  StepReport report;
  report.outcome = decision.outcome;
  report.step = step;
  report.loss = global.loss;
  report.grad_norm = global.grad_norm;
  report.nonfinite_count = global.nonfinite_count();
  report.actions = decision.actions;
  report.batches_to_skip = decision.batches_to_skip;
  report.loss_scale = decided.loss_scale;
  report.lr_factor = decided.lr_factor;
  report.rolled_back_to = rolled_back_to;
  if (rolled_back_to > 0) {
    // The knobs now hold the restored values (plus this step's own actions).
    report.loss_scale = s.controller.loss_scale();
    report.lr_factor = s.controller.lr_factor();
  }

  if (signals.any()) {
    Incident incident;
    incident.step = step;
    incident.signal = to_string(signals.raised.front());
    incident.action = to_string(strongest(decision.actions));
    incident.tensors = blamed;
    incident.ranks = global.faulty_ranks;
    incident.reason = reason;
    incident.cause = diagnosis.cause;
    incident.evidence = diagnosis.evidence;
    incident.fixes = diagnosis.fixes;
    if (!s.options.incident_dir().empty()) {
      auto replay_word = [](forensics::ReplayResult r) {
        return r == forensics::ReplayResult::kNotRun       ? "not run"
               : r == forensics::ReplayResult::kReproduced ? "non-finite again"
                                                           : "finite";
      };
      nlohmann::json r = {{"step", step},
                          {"signal", incident.signal},
                          {"action", incident.action},
                          {"cause", incident.cause},
                          {"evidence", incident.evidence},
                          {"fixes", incident.fixes},
                          {"tensors", incident.tensors},
                          {"ranks", incident.ranks},
                          {"rank", s.consensus->rank()},
                          {"reason", incident.reason}};
      nlohmann::json actions = nlohmann::json::array();
      for (Action a : decision.actions) actions.push_back(to_string(a));
      r["actions"] = actions;
      r["replay"] = {{"rerun", replay_word(evidence.rerun)},
                     {"fp32", replay_word(evidence.fp32)},
                     {"anomaly_op", evidence.anomaly_op}};
      if (!evidence.anomaly_message.empty()) r["replay"]["message"] = evidence.anomaly_message;
      if (!evidence.nonfinite_params.empty()) r["nonfinite_params"] = evidence.nonfinite_params;
      if (!evidence.first_bad_forward.empty() || !evidence.first_bad_backward.empty()) {
        r["probes"] = {{"first_bad_forward", evidence.first_bad_forward},
                       {"first_bad_backward", evidence.first_bad_backward}};
      }
      nlohmann::json history = nlohmann::json::array();
      auto num = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); };
      for (const auto& h : s.history) {
        history.push_back({{"step", h.step},
                           {"loss", num(h.loss)},
                           {"grad_norm", num(h.grad_norm)},
                           {"loss_scale", num(h.loss_scale)},
                           {"lr_factor", num(h.lr_factor)},
                           {"outcome", h.outcome}});
      }
      history.push_back({{"step", step},
                         {"loss", num(global.loss)},
                         {"grad_norm", num(global.grad_norm)},
                         {"loss_scale", num(report.loss_scale)},
                         {"lr_factor", num(report.lr_factor)},
                         {"outcome", to_string(report.outcome)}});
      r["history"] = history;
      incident.report = s.write_incident_report(step, r);
    }
    if (s.metrics) s.metrics->record_cause(incident.cause);
    report.incident = std::move(incident);
    ++s.totals.incidents;
  }
  decision.reason = reason;
  if (s.event_log) s.event_log->record(report, global, signals, decision, blamed);
  if (s.metrics) {
    s.metrics->record_step(report, signals.consecutive_bad_steps, inspect_seconds,
                           consensus_seconds);
  }
  s.history.push_back({step, global.loss, global.grad_norm, report.loss_scale, report.lr_factor,
                       to_string(report.outcome)});
  while (s.history.size() > Impl::kHistory) s.history.pop_front();
  s.bad_inputs.clear();
  s.checked_inputs.clear();
  s.probes->clear();
  *s.probe_grads_seen = 0;
  if (s.replay) s.forward_rng = Impl::rng_state();  // for the next step's replays
  return report;
}

std::int64_t GuardedOptimizer::step_count() const noexcept { return impl_->step; }
GuardState GuardedOptimizer::state() const noexcept { return impl_->state(); }
void GuardedOptimizer::restore_state(const GuardState& state) {
  TORCH_CHECK(state.step >= 0, "stepguard: restore_state got a negative step ", state.step);
  if (state.words.empty()) {
    impl_->controller.reset();
  } else {
    try {
      impl_->controller.decode(state.words);
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK(false, "stepguard: restore_state: ", e.what());
    }
  }
  impl_->step = state.step;
}
torch::Tensor GuardedOptimizer::scale_loss(const torch::Tensor& loss) const {
  if (!impl_->controller.loss_scaling()) return loss;
  return loss * impl_->replay_scale.value_or(impl_->controller.loss_scale());
}
double GuardedOptimizer::loss_scale() const noexcept { return impl_->controller.loss_scale(); }
double GuardedOptimizer::lr_factor() const noexcept { return impl_->controller.lr_factor(); }
std::string GuardedOptimizer::metrics_endpoint() const {
  return impl_->metrics ? impl_->metrics->endpoint() : std::string();
}
std::string GuardedOptimizer::metrics_text() const {
  return impl_->metrics ? impl_->metrics->serialize() : std::string();
}
int GuardedOptimizer::rank() const noexcept { return impl_->consensus->rank(); }
int GuardedOptimizer::world_size() const noexcept { return impl_->consensus->world_size(); }
GuardTotals GuardedOptimizer::totals() const noexcept { return impl_->totals; }
std::int64_t GuardedOptimizer::resume(const std::string& dir) {
  Impl& s = *impl_;
  TORCH_CHECK(!s.aborted, "stepguard: resume() after an abort");
  const int rank = s.consensus->rank();
  const int world = s.consensus->world_size();
  const auto entries = checkpoint::list_checkpoints(dir);
  std::int64_t bound = std::numeric_limits<std::int64_t>::max();
  for (std::size_t round = 0; round <= entries.size(); ++round) {
    // This rank's newest valid checkpoint below the bound, then the newest all ranks hold.
    std::int64_t mine = 0;
    for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
      if (it->step >= bound) continue;
      if (it->world_size != world) {
        std::fprintf(stderr, "stepguard: skipping %s: written by %d ranks, this run has %d\n",
                     it->dir.c_str(), it->world_size, world);
        continue;
      }
      try {
        checkpoint::read_rank_file(*it, rank);
        mine = it->step;
        break;
      } catch (const checkpoint::CheckpointError& e) {
        std::fprintf(stderr, "stepguard: skipping a bad checkpoint: %s\n", e.what());
      }
    }
    const std::int64_t agreed = s.agree_min(mine, -1);
    if (agreed == 0) return 0;
    bool ok = false;
    checkpoint::GuardRecord record;
    std::string where;
    for (const auto& e : entries) {
      if (e.step != agreed) continue;
      where = e.dir;
      try {
        record = checkpoint::decode_payload(checkpoint::read_rank_file(e, rank),
                                            e.dir + "/rank " + std::to_string(rank),
                                            s.state_tensors(), s.optimizer);
        s.controller.decode(record.guard);
        ok = record.step == agreed && record.totals.size() == 8 &&
             record.skipped_ranges.size() % 2 == 0;
      } catch (const std::exception& e2) {
        std::fprintf(stderr, "stepguard: cannot resume from %s: %s\n", e.dir.c_str(), e2.what());
      }
    }
    const auto oks = s.gather(ok ? 1 : 0, -1);
    if (std::all_of(oks.begin(), oks.end(), [](std::int64_t v) { return v == 1; })) {
      s.step = record.step;
      s.data_position = record.data_position;
      const auto& t = record.totals;
      s.totals = GuardTotals{t[0], t[1], t[2], t[3], t[4], t[5], t[6]};
      s.checkpoints_written = t[7];
      s.skipped_ranges.clear();
      for (std::size_t i = 0; i + 1 < record.skipped_ranges.size(); i += 2) {
        s.skipped_ranges.push_back({record.skipped_ranges[i], record.skipped_ranges[i + 1]});
      }
      if (s.snapshots) s.snapshots->clear();
      s.pending_disk_step = 0;
      if (rank == 0) {
        std::fprintf(stderr,
                     "stepguard: resumed from %s (step %" PRId64 ", data position %" PRId64 ")\n",
                     where.c_str(), s.step, s.data_position);
      }
      return s.step;
    }
    bound = agreed;  // some rank could not load it: try an older one
  }
  return 0;
}
bool GuardedOptimizer::check_inputs(const std::vector<torch::Tensor>& inputs,
                                    const torch::Tensor& mask) {
  Impl& s = *impl_;
  TORCH_CHECK(!mask.defined() || mask.dim() == 2,
              "stepguard: check_inputs: the mask must be [batch, sequence], got ", mask.sizes());
  if (s.replay) s.forward_rng = Impl::rng_state();  // closest to the forward pass
  s.checked_inputs.clear();
  s.bad_inputs.clear();
  // Counts are reduced where the tensors live and read back once for the whole batch; the
  // inputs are kept by reference and copied to the host only if a report saves them.
  std::vector<std::size_t> counted;
  std::vector<at::Tensor> counts;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const auto& t = inputs[i];
    if (!t.defined()) continue;
    s.checked_inputs.push_back(t.detach());
    if (!at::isFloatingType(t.scalar_type())) continue;
    counted.push_back(i);
    counts.push_back((~at::isfinite(t.detach())).sum());
  }
  if (mask.defined()) counts.push_back((~mask.to(at::kBool).any(1)).sum());
  if (counts.empty()) return true;
  for (auto& n : counts) n = n.to(counts.front().device(), at::kLong);
  const at::Tensor host = at::stack(counts).to(at::kCPU);  // the one read
  const std::int64_t* c = host.data_ptr<std::int64_t>();
  for (std::size_t k = 0; k < counted.size(); ++k) {
    if (c[k] > 0) {
      s.bad_inputs.push_back("input " + std::to_string(counted[k]) + " holds " +
                             std::to_string(c[k]) + " NaN/Inf value" + (c[k] > 1 ? "s" : ""));
    }
  }
  if (mask.defined()) {
    const std::int64_t empty = c[counted.size()];
    if (empty > 0) {
      s.bad_inputs.push_back(std::to_string(empty) + " of " + std::to_string(mask.size(0)) +
                             " sequences are empty or all padding (every position masked)");
    }
    if (mask.size(1) == 0) s.bad_inputs.push_back("the sequences have length 0");
  }
  return s.bad_inputs.empty();
}
torch::Tensor GuardedOptimizer::probe(const std::string& name, const torch::Tensor& output) {
  Impl& s = *impl_;
  if (s.replaying || !output.defined()) return output;  // replays do not add records
  Impl::ProbeRecord record;
  record.name = name;
  if (at::isFloatingType(output.scalar_type())) {
    record.forward_finite = at::isfinite(output.detach()).all().item<bool>();
  }
  const std::size_t index = s.probes->size();
  s.probes->push_back(record);
  if (output.requires_grad()) {
    // Shared state: a hook may outlive this step's records (they are cleared after step()).
    auto probes = s.probes;
    auto seen = s.probe_grads_seen;
    const_cast<torch::Tensor&>(output).register_hook([probes, seen, index](torch::Tensor grad) {
      if (index < probes->size() && (*probes)[index].backward_order < 0 && grad.defined()) {
        (*probes)[index].backward_order = (*seen)++;
        (*probes)[index].grad_finite = at::isfinite(grad).all().item<bool>();
      }
      return grad;
    });
  }
  return output;
}
void GuardedOptimizer::set_replay(std::function<torch::Tensor(ReplayMode)> recompute) {
  const bool first = !impl_->replay;
  impl_->replay = std::move(recompute);
  if (first && impl_->replay && impl_->step == 0) impl_->forward_rng = Impl::rng_state();
}
void GuardedOptimizer::track_buffers(
    const torch::OrderedDict<std::string, torch::Tensor>& named_buffers) {
  impl_->buffers.clear();
  for (const auto& item : named_buffers) {
    if (item.value().defined()) impl_->buffers.push_back(item.value());
  }
}
std::int64_t GuardedOptimizer::data_position() const noexcept { return impl_->data_position; }
void GuardedOptimizer::set_data_position(std::int64_t position) {
  TORCH_CHECK(position >= 0, "stepguard: data position must be >= 0, got ", position);
  impl_->data_position = position;
}
const std::vector<std::pair<std::int64_t, std::int64_t>>& GuardedOptimizer::skipped_ranges()
    const noexcept {
  return impl_->skipped_ranges;
}
std::int64_t GuardedOptimizer::checkpoints_written() const noexcept {
  return impl_->checkpoints_written;
}
void GuardedOptimizer::commit_pending_checkpoint() {
  Impl& s = *impl_;
  if (s.pending_disk_step == 0 || s.aborted) return;
  if (s.consensus->rank() == 0) {
    checkpoint::commit_checkpoint(s.options.checkpoint_dir(), s.pending_disk_step,
                                  s.consensus->world_size(), s.disk_keep);
  }
  ++s.checkpoints_written;
  if (s.metrics) s.metrics->record_checkpoint(s.pending_disk_step, s.pending_disk_seconds);
  s.pending_disk_step = 0;
}
std::size_t GuardedOptimizer::snapshots_held() const noexcept {
  return impl_->snapshots ? impl_->snapshots->size() : 0;
}
std::int64_t GuardedOptimizer::snapshot_bytes() const noexcept {
  return impl_->snapshots ? impl_->snapshots->bytes() : 0;
}
bool GuardedOptimizer::aborted() const noexcept { return impl_->aborted; }
std::int64_t GuardedOptimizer::collectives() const noexcept {
  return impl_->consensus->collectives();
}
const std::vector<torch::Tensor>& GuardedOptimizer::parameters() const noexcept {
  return impl_->params;
}
const std::vector<std::string>& GuardedOptimizer::parameter_names() const noexcept {
  return impl_->names;
}
const GuardOptions& GuardedOptimizer::options() const noexcept { return impl_->options; }
torch::optim::Optimizer& GuardedOptimizer::optimizer() noexcept { return impl_->optimizer; }

}  // namespace stepguard
