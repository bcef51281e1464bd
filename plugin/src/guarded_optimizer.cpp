// GuardedOptimizer: wires the engine modules together for one guarded step. Nothing else.
#include "stepguard/guarded_optimizer.h"

#include <c10/util/Exception.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <unordered_map>

#include "csrc/consensus/consensus.h"
#include "csrc/consensus/nccl_probe.h"
#include "csrc/consensus/process_group_consensus.h"
#include "csrc/inspect/cuda/inspect_cuda.h"
#include "csrc/inspect/inspect.h"
#include "csrc/policy/policy.h"
#include "csrc/policy/policy_file.h"
#include "csrc/scaling/loss_scaler.h"
#include "csrc/telemetry/event_log.h"
#include "csrc/telemetry/metrics.h"
#include "stepguard/version.h"

namespace stepguard {

namespace {

// FNV-1a over the decision state, masked to an integer fp64 holds exactly.
std::uint64_t digest_of(const GuardState& state) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  std::int64_t scale_bits = 0;
  std::memcpy(&scale_bits, &state.loss_scale, sizeof scale_bits);
  for (std::int64_t v : {state.step, state.consecutive_bad_steps, state.bad_steps_total, scale_bits,
                         state.loss_scale_growth_tracker, state.loss_scale_hysteresis_left,
                         state.loss_scale_steps_at_floor}) {
    for (int byte = 0; byte < 8; ++byte) {
      h ^= static_cast<std::uint64_t>(v >> (8 * byte)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  }
  return h & stats_slot::kDigestMask;
}

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

GlobalStats unpack_global_stats(const at::Tensor& buffer, int world_size, std::int64_t step) {
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
  g.sum_squares =
      g.sum_squares_overflow ? std::numeric_limits<double>::infinity() : s[stats_slot::kSumSquares];
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
  if (options.policy_file().empty()) {
    policy::PolicyConfig config;
    config.max_consecutive_bad_steps = options.max_consecutive_bad_steps();
    return config;
  }
  TORCH_CHECK(options.max_consecutive_bad_steps() == 0,
              "stepguard: max_consecutive_bad_steps is set both in GuardOptions and through the "
              "policy file '",
              options.policy_file(), "'; set it in one place");
  return policy::load_policy_file(options.policy_file());
}

// The strongest action of a decision names the incident.
Action strongest(const std::vector<Action>& actions) {
  Action best = Action::kApply;
  for (Action a : actions) {
    if (static_cast<int>(a) > static_cast<int>(best)) best = a;
  }
  return best;
}

}  // namespace

struct GuardedOptimizer::Impl {
  Impl(torch::optim::Optimizer& opt, GuardOptions opts)
      : optimizer(opt),
        options(std::move(opts)),
        consensus(make_consensus(options)),
        policy_config(policy_config_of(options)),
        engine(policy_config) {
    if (policy_config.has_loss_scale ? policy_config.loss_scale.enabled : options.loss_scaling()) {
      const policy::LossScaleSettings& l = policy_config.loss_scale;  // defaults = GradScaler's
      scaling::LossScalerConfig c;
      c.init_scale = l.init_scale;
      c.growth_factor = l.growth_factor;
      c.backoff_factor = l.backoff_factor;
      c.growth_interval = l.growth_interval;
      c.hysteresis = l.hysteresis;
      c.min_scale = l.min_scale;
      scaler.emplace(c);
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
      mc.loss_scale_min = scaler ? scaler->config().min_scale : 0.0;
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
    GuardState g{step, engine.state().consecutive_bad_steps, engine.state().bad_steps_total};
    if (scaler) {
      g.loss_scale = scaler->state().scale;
      g.loss_scale_growth_tracker = scaler->state().growth_tracker;
      g.loss_scale_hysteresis_left = scaler->state().hysteresis_left;
      g.loss_scale_steps_at_floor = scaler->state().steps_at_floor;
    }
    return g;
  }

  torch::optim::Optimizer& optimizer;
  GuardOptions options;
  std::unique_ptr<consensus::Consensus> consensus;
  policy::PolicyConfig policy_config;
  policy::PolicyEngine engine;
  std::optional<scaling::LossScaler> scaler;
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
  if (s.scaler) {
    // The fused pass unscales in place: the optimizer then sees true gradients.
    inspect_options.inv_scale = s.scaler->inv_scale();
    inspect_options.unscale_in_place = true;
  }
  // The step's one buffer, on the gradients' device: inspection writes its first four slots.
  at::Tensor buffer = at::zeros({stats_slot::size(s.consensus->world_size())},
                                at::TensorOptions().dtype(at::kDouble).device(loss.device()));
  LocalStats local;
  inspect::DeferredBlame deferred_blame;
  inspect::inspect_into(grads, inspect_options, buffer.narrow(0, 0, 4), &local, &deferred_blame);
  const double inspect_seconds = std::chrono::duration<double>(Clock::now() - t_inspect).count();
  const std::uint64_t digest = digest_of(s.state());
  const std::int64_t step = ++s.step;
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
  const GlobalStats global = unpack_global_stats(buffer, s.consensus->world_size(), step);
  const double consensus_seconds =
      std::chrono::duration<double>(Clock::now() - t_consensus).count();

  // 3 detect, 4 decide.
  const Signals signals = s.engine.detect(global);
  Decision decision = s.engine.decide(signals);
  if (s.scaler) {
    // GradScaler's rule: back off on any overflow, grow after a clean run.
    const bool overflow = global.nonfinite_count() > 0 || global.loss_nonfinite_ranks > 0;
    s.scaler->update(overflow);
    if (overflow && decision.outcome != Outcome::kApplied) {
      decision.actions.push_back(Action::kDropLossScale);
    }
  }

  // 5 act.
  switch (decision.outcome) {
    case Outcome::kApplied:
      s.optimizer.step();
      ++s.totals.applied;
      break;
    case Outcome::kSkipped:
    case Outcome::kRolledBack:
      if (s.options.zero_grad_on_skip()) s.zero_grads();
      ++s.totals.skipped;
      break;
    case Outcome::kAborted:
      if (s.options.zero_grad_on_skip()) s.zero_grads();
      s.aborted = true;
      s.abort_reason = decision.reason;
      ++s.totals.aborted;
      break;
  }
  ++s.totals.steps;

  // 6 record.
  StepReport report;
  report.outcome = decision.outcome;
  report.step = step;
  report.loss = global.loss;
  report.grad_norm = global.grad_norm;
  report.nonfinite_count = global.nonfinite_count();
  report.actions = decision.actions;
  report.batches_to_skip = decision.batches_to_skip;
  report.loss_scale = s.scaler ? s.scaler->scale() : 1.0;

  // Per-tensor results left on the device are read only when this rank has something to blame.
  if (deferred_blame.pending() && std::find(global.faulty_ranks.begin(), global.faulty_ranks.end(),
                                            s.consensus->rank()) != global.faulty_ranks.end()) {
    deferred_blame.fetch(&local);
  }
  std::vector<std::string> blamed;
  for (std::int64_t idx : local.nonfinite_tensors) {
    if (static_cast<std::int64_t>(blamed.size()) >= s.options.max_blamed_tensors()) break;
    blamed.push_back(s.names[static_cast<std::size_t>(idx)]);
  }
  if (signals.any()) {
    Incident incident;
    incident.step = step;
    incident.signal = to_string(signals.raised.front());
    incident.action = to_string(strongest(decision.actions));
    incident.tensors = blamed;
    incident.ranks = global.faulty_ranks;
    incident.reason = decision.reason;
    report.incident = std::move(incident);
    ++s.totals.incidents;
  }
  if (s.event_log) s.event_log->record(report, global, decision.reason, blamed);
  if (s.metrics) {
    s.metrics->record_step(report, signals.consecutive_bad_steps, inspect_seconds,
                           consensus_seconds);
  }
  return report;
}

std::int64_t GuardedOptimizer::step_count() const noexcept { return impl_->step; }
GuardState GuardedOptimizer::state() const noexcept { return impl_->state(); }
void GuardedOptimizer::restore_state(const GuardState& state) {
  TORCH_CHECK(state.step >= 0 && state.consecutive_bad_steps >= 0 && state.bad_steps_total >= 0,
              "stepguard: restore_state got a negative counter");
  impl_->step = state.step;
  impl_->engine.restore(policy::EngineState{state.consecutive_bad_steps, state.bad_steps_total});
  if (impl_->scaler) {
    TORCH_CHECK(state.loss_scale > 0 && std::isfinite(state.loss_scale),
                "stepguard: restore_state got loss scale ", state.loss_scale);
    impl_->scaler->restore(scaling::LossScalerState{
        state.loss_scale, state.loss_scale_growth_tracker, state.loss_scale_hysteresis_left,
        state.loss_scale_steps_at_floor});
  }
}
torch::Tensor GuardedOptimizer::scale_loss(const torch::Tensor& loss) const {
  return impl_->scaler ? loss * impl_->scaler->scale() : loss;
}
double GuardedOptimizer::loss_scale() const noexcept {
  return impl_->scaler ? impl_->scaler->scale() : 1.0;
}
std::string GuardedOptimizer::metrics_endpoint() const {
  return impl_->metrics ? impl_->metrics->endpoint() : std::string();
}
std::string GuardedOptimizer::metrics_text() const {
  return impl_->metrics ? impl_->metrics->serialize() : std::string();
}
int GuardedOptimizer::rank() const noexcept { return impl_->consensus->rank(); }
int GuardedOptimizer::world_size() const noexcept { return impl_->consensus->world_size(); }
GuardTotals GuardedOptimizer::totals() const noexcept { return impl_->totals; }
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
