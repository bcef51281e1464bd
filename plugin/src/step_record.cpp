// StepEngine's record stage and its forensics: what this rank can tell about an incident
// (blame, evidence, replays, cause), the report and incident files, the trace and the metrics.
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iterator>
#include <sstream>

#include "csrc/checkpoint/disk_checkpoint.h"
#include "csrc/common/json_text.h"
#include "csrc/forensics/input_check.h"
#include "csrc/forensics/report.h"
#include "csrc/policy/trend.h"
#include "plugin/src/step_engine.h"

namespace stepguard {

namespace {

// A grad-norm spike the policy only clipped is a figure of the run, not an incident: a norm
// above its running statistics is part of a healthy run's scatter (a data-shard change, a noisy
// small batch), and the clip is the whole answer. It is counted (the report's and the trace's
// actions, the clip metric); no forensics, no incident, no log line.
bool clip_only(const StepDecision& decided) {
  const Signals& s = decided.signals;
  const bool only_norm = std::all_of(s.raised.begin(), s.raised.end(),
                                     [](Signal r) { return r == Signal::kGradNormSpike; });
  const auto& a = decided.decision.actions;
  return only_norm && std::all_of(a.begin(), a.end(), [](Action x) {
           return x == Action::kApply || x == Action::kClip;
         });
}

// The weights before the step (incident steps only, one read per tensor): those holding NaN/Inf,
// and those holding a value above kHugeWeight (named when the loss is non-finite).
void weight_evidence(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
                     forensics::Evidence* ev) {
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;                         // a shard this rank does not hold
    const double largest = params[i].abs().max().item<double>();  // NaN and Inf propagate
    if (!std::isfinite(largest)) {
      ev->nonfinite_params.push_back(names[i]);
    } else if (largest > forensics::kHugeWeight) {
      std::ostringstream s;
      s << names[i] << " (largest " << largest << ")";
      ev->huge_params.push_back(s.str());
    }
  }
}

// What a loss spike and the recovery watch add to the evidence: the ranks' losses, the ranks
// whose loss rose (when not every rank's did), the level before and the watch's figures.
void spike_evidence(const GlobalStats& g, const Signals& s, int rank, std::int64_t step,
                    forensics::Evidence* ev) {
  ev->loss_spike = s.has(Signal::kLossSpike) || s.has(Signal::kLossRatio);
  ev->grad_norm_spike = s.has(Signal::kGradNormSpike);
  ev->loss_level = s.loss_level;
  ev->rank_losses = g.rank_losses;
  const auto r = static_cast<std::size_t>(rank);
  ev->rank_loss = r < g.rank_losses.size() ? g.rank_losses[r] : g.world_size == 1 ? g.loss : 0.0;
  if (ev->loss_spike && g.ranks_named && !g.origin_ranks.empty() && !g.nonfinite()) {
    ev->spike_ranks = g.origin_ranks;
  }
  ev->loss_not_recovered = s.has(Signal::kLossNotRecovered);
  if (s.diverging_since > 0) {
    ev->diverging_steps = step - s.diverging_since;
    ev->grad_norm_level = s.grad_norm_level;
    ev->escalations = s.escalations;
  }
}

// What the trend detectors that raised saw (a shifted rank's loss names the rank once the ranks
// were named), and the cause and first fixes of the first one's kind.
void trend_evidence(const GlobalStats& g, const Signals& s, forensics::Evidence* ev) {
  for (const TrendNote& note : s.trends) {
    std::string what = note.what;
    if (note.signal == Signal::kRankLossShift && g.ranks_named && !g.origin_ranks.empty()) {
      what += " (rank " + rank_list(g.origin_ranks) + ")";
    }
    ev->trend_findings.push_back(std::move(what));
    const policy::TrendKind* kind = policy::trend_kind(note.signal);
    if (ev->trend_findings.size() == 1 && kind != nullptr) {
      ev->trend_cause = kind->cause;
      ev->trend_fixes = kind->fixes;
    }
  }
}

}  // namespace

// The optimizer state check's finding: what it saw, the state tensors that hold it (each rank
// names its own; one exchange, the signal being agreed, gives every rank all of them) and the
// kind's fixes.
void StepEngine::state_evidence(const Signals& signals, Findings* f) {
  forensics::Evidence& ev = f->evidence;
  const policy::TrendKind* kind = policy::trend_kind(Signal::kOptimizerState);
  for (const TrendNote& note : signals.trends) {
    if (note.signal == Signal::kOptimizerState) ev.state_findings.push_back(note.what);
  }
  const auto max = static_cast<std::size_t>(options_.max_blamed_tensors());
  std::vector<std::string> mine = state_check_.bad_tensors(max, port_);
  if (consensus_->world_size() > 1) mine = blame_across_ranks(mine, step_);
  std::string held;
  for (const std::string& name : mine) held += (held.empty() ? "" : ", ") + name;
  if (!held.empty()) ev.state_findings.push_back("the state tensors that hold them: " + held);
  ev.state_fixes = kind != nullptr ? kind->fixes : std::vector<std::string>();
  if (f->blamed.empty()) f->blamed = std::move(mine);
}

StepEngine::Findings StepEngine::investigate(const Agreed& agreed, const StepDecision& decided) {
  RECORD_USER_SCOPE("stepguard::forensics");
  Findings f;
  if (!decided.signals.any() || clip_only(decided)) return f;
  const GlobalStats& g = agreed.global;
  LocalStats local = agreed.local;
  // Per-tensor results left on the device are read only when this rank has something to blame.
  const auto& faulty = g.faulty_ranks;
  if (agreed.blame.pending() &&
      std::find(faulty.begin(), faulty.end(), consensus_->rank()) != faulty.end()) {
    agreed.blame.fetch(&local);
  }
  // Blame in backward order: the last layers' gradients are computed first.
  const auto& names = port_.parameter_names();
  for (auto it = local.nonfinite_tensors.rbegin(); it != local.nonfinite_tensors.rend(); ++it) {
    if (static_cast<std::int64_t>(f.blamed.size()) >= options_.max_blamed_tensors()) break;
    f.blamed.push_back(names[static_cast<std::size_t>(*it)]);
  }
  // Under sharding, tensor or pipeline parallelism a rank sees only its own gradients, and under
  // data parallelism a fault made after the average stays on its rank: every rank learns what the
  // others blame, so every rank's incident names the same tensors (the condition is agreed).
  const int world = consensus_->world_size();
  if (world > 1 && g.nonfinite_count() > 0 &&
      (!job_replicated_ || static_cast<int>(faulty.size()) < world)) {
    f.blamed = blame_across_ranks(f.blamed, step_);
  }
  forensics::Evidence& ev = f.evidence;
  ev.loss_nonfinite = g.loss_nonfinite_ranks > 0;
  ev.grads_nonfinite = g.nonfinite_count() > 0;
  ev.nan_count = g.nan_count;
  ev.inf_count = g.inf_count;
  spike_evidence(g, decided.signals, consensus_->rank(), step_, &ev);
  trend_evidence(g, decided.signals, &ev);
  ev.overflow_ruled_out = g.overflow_ruled_out;
  ev.restored_from = restored_from_;
  ev.loss_scaling = controller_.loss_scaling() || framework_scale_.has_value();
  const double floor =
      framework_scale_ ? framework_scale_->min_scale : controller_.loss_scale_floor();
  ev.loss_scale_at_floor = ev.loss_scaling && floor > 0 && step_loss_scale_ <= floor;
  ev.inputs_checked = input_check_ != nullptr;
  if (input_check_) ev.bad_inputs = input_check_->problems();  // the read, on incidents only
  ev.diverged_replica = std::find(g.diverged_replicas.begin(), g.diverged_replicas.end(),
                                  consensus_->rank()) != g.diverged_replicas.end();
  if (!g.diverged_replicas.empty()) {
    // One gather on every rank (the condition is agreed): the tensors that differ, named even
    // on a step whose gradients also hold NaN (the incident's tensors are then those).
    ev.diverged_tensors = diverged_tensor_names(g);
    if (f.blamed.empty()) f.blamed = ev.diverged_tensors;
  }
  if (decided.signals.has(Signal::kOptimizerState)) state_evidence(decided.signals, &f);
  ev.blamed_grads = f.blamed;
  ev.loss_scale = step_loss_scale_;
  ev.grad_norm = g.grad_norm;
  ev.loss = g.loss;
  for (const auto& h : history_) {
    ev.recent_grad_norms.push_back(h.grad_norm);
    ev.recent_losses.push_back(h.loss);
  }
  weight_evidence(port_.parameters(), names, &ev);
  ev.grads_bad_before_reduction =  // one read, on incident steps
      watched_grad_sum_.defined() && !std::isfinite(watched_grad_sum_.item<double>());
  probes_.fill(&ev);
  // Under data parallelism a fault of one rank reaches every rank's gradients through the
  // average: only the ranks it came from replay and classify on their own evidence.
  f.origin_ranks = g.ranks_named ? g.origin_ranks : std::vector<int>();
  f.origin = !g.ranks_named || f.origin_ranks.empty() ||
             std::find(f.origin_ranks.begin(), f.origin_ranks.end(), consensus_->rank()) !=
                 f.origin_ranks.end();
  if (f.origin) {
    // Replays cost a few forward/backward passes: once per streak of bad steps, at its start.
    if (replay_ && agreed.global.nonfinite() && decided.signals.consecutive_bad_steps <= 1) {
      run_replays(&ev);
    }
    f.diagnosis = forensics::classify(ev);
  }
  agree_causes(step_, g, &f);
  return f;
}

void StepEngine::run_replays(forensics::Evidence* ev) {
  replaying_ = true;
  // Replays must not move the training's random streams, nor the tracked module buffers their
  // forward passes update (batch-norm running statistics): each replay starts from the step's,
  // and the step ends with them as its own forward left them.
  const checkpoint::RngState training_rng = checkpoint::capture_rng();
  std::vector<at::Tensor> buffers;
  {
    at::NoGradGuard no_grad;
    for (const at::Tensor& b : recovery_.tracked_buffers()) buffers.push_back(b.clone());
  }
  const auto restore_buffers = [&] {
    at::NoGradGuard no_grad;
    const auto& live = recovery_.tracked_buffers();
    for (std::size_t i = 0; i < buffers.size(); ++i) live[i].copy_(buffers[i]);
  };
  replay_scale_ = step_loss_scale_;  // "as is": the scale of the step, not the backed-off one
  forensics::run_replays(
      replay_,
      [&] {
        checkpoint::restore_rng(forward_rng_);
        restore_buffers();
      },
      port_.parameters(), controller_.loss_scaling(), ev);
  // The step's own probes (none, or the user's) come first; else what the replay's saw.
  if (ev->first_bad_forward.empty() && ev->first_bad_backward.empty()) replay_probes_.fill(ev);
  replay_probes_.clear();
  replay_scale_.reset();
  replaying_ = false;
  restore_buffers();
  checkpoint::restore_rng(training_rng);
}

StepReport StepEngine::record(std::int64_t step, const Agreed& agreed, const StepDecision& decided,
                              const Findings& findings) {
  RECORD_USER_SCOPE("stepguard::record");
  StepReport report = make_report(step, agreed.global, decided);
  report.deferred = resolving_deferred_;
  report.incident = make_incident(step, agreed, decided, findings, report);
  restored_from_ = report.outcome == Outcome::kRolledBack ? report.rolled_back_to : 0;
  if (report.incident) {
    ++totals_.incidents;
    last_incident_step_ = step;
  }
  if (event_log_) {
    try {
      event_log_->record(report, agreed.global, decided.signals, decided.decision, findings.blamed);
    } catch (const std::exception& e) {
      // The step is done (applied or not): a trace line that cannot be written is counted and
      // said, and training goes on, as for a disk checkpoint that cannot be written.
      if (trace_failures_++ % 1000 == 0) {
        std::fprintf(stderr,
                     "stepguard: step %" PRId64 ": %s; the step stands (%" PRId64
                     " trace line(s) lost so far)\n",
                     step, e.what(), trace_failures_);
      }
    }
  }
  if (metrics_) {
    // A cause is exported by the rank it came from: a page names that rank and its host.
    if (report.incident && findings.origin) metrics_->record_cause(findings.diagnosis.cause);
    metrics_->record_step(report, decided.signals.consecutive_bad_steps, agreed.inspect_seconds,
                          agreed.agree_seconds);
  }
  history_.push_back({step, agreed.global.loss, agreed.global.grad_norm, report.loss_scale,
                      report.lr_factor, report.outcome});
  while (history_.size() > kHistory) history_.pop_front();
  input_check_.reset();
  probes_.clear();
  if (watched_grad_sum_.defined()) watched_grad_sum_.zero_();
  if (replay_) forward_rng_ = checkpoint::capture_rng();  // for the next step's replays
  return report;
}

std::optional<Incident> StepEngine::make_incident(std::int64_t step, const Agreed& agreed,
                                                  const StepDecision& decided,
                                                  const Findings& findings,
                                                  const StepReport& report) {
  if (!decided.signals.any() || clip_only(decided)) return std::nullopt;
  Incident incident;
  incident.step = step;
  incident.signal = decided.signals.raised.front();
  incident.action = report.action;
  incident.tensors = findings.blamed;
  incident.ranks = findings.origin_ranks;
  incident.origin_unknown = agreed.global.origin_unknown;
  incident.reason = decided.decision.reason;
  incident.cause = findings.agreed_cause;
  incident.rank_causes = findings.rank_causes;
  incident.evidence = findings.diagnosis.evidence;
  incident.fixes = findings.diagnosis.fixes;
  if (findings.origin && findings.agreed_cause != findings.diagnosis.cause) {
    incident.evidence.push_back(
        "this rank found " + std::string(to_string(findings.diagnosis.cause)) +
        "; the job's agreed cause is " + to_string(findings.agreed_cause) +
        " (the first in the debugging order among the origin ranks' causes)");
  }
  if (!options_.incident_dir().empty()) {
    std::vector<forensics::HistoryRow> rows(history_.begin(), history_.end());
    rows.push_back({step, agreed.global.loss, agreed.global.grad_norm, report.loss_scale,
                    report.lr_factor, report.outcome});
    nlohmann::json json = forensics::incident_json(
        incident, consensus_->rank(), decided.decision.actions, findings.evidence, rows);
    incident.report = write_incident_files(step, json);
  }
  return incident;
}

// Writes the JSON and Markdown report (and the checked batch); returns the JSON's path, or empty
// when it could not be written (said on stderr: a report never stops training).
std::string StepEngine::write_incident_files(std::int64_t step, nlohmann::json& json) {
  namespace fs = std::filesystem;
  const std::string& dir = options_.incident_dir();
  char name[64];
  std::snprintf(name, sizeof name, "incident-step-%09" PRId64, step);
  const std::string rank_prefix =
      consensus_->world_size() > 1 ? "rank-" + std::to_string(consensus_->rank()) + "-" : "";
  std::string prefix = dir + "/" + rank_prefix + name;
  try {
    fs::create_directories(dir);
    // Reports already there (another run's in a shared incident_dir, or this run's before a
    // resume) are kept: this one takes the first free name, <name>.1, <name>.2, ...
    const auto taken = [](const std::string& p) {
      std::error_code ec;
      return fs::symlink_status(p + ".json", ec).type() != fs::file_type::not_found ||
             fs::symlink_status(p + ".md", ec).type() != fs::file_type::not_found ||
             fs::symlink_status(p + ".batch.pt", ec).type() != fs::file_type::not_found;
    };
    const std::string base = prefix;
    for (int n = 1; taken(prefix); ++n) {
      TORCH_CHECK(n <= 1000, "1000 reports of this step are there already");
      prefix = base + "." + std::to_string(n);
    }
    if (input_check_ && !input_check_->inputs.empty()) {
      std::vector<torch::Tensor> host;
      for (const auto& t : input_check_->inputs) host.push_back(t.to(at::kCPU));
      // Through the atomic writer (a fresh file, no link followed), as the reports.
      std::ostringstream bytes;
      torch::save(host, bytes);
      checkpoint::write_file_atomically(prefix + ".batch.pt", bytes.str());
      json["batch"] = prefix + ".batch.pt";
    }
    checkpoint::write_file_atomically(prefix + ".json", dump_json(json, 2) + "\n");
    checkpoint::write_file_atomically(prefix + ".md", forensics::render_markdown(json));
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "stepguard: step %" PRId64 ": cannot write the incident report to %s: %s\n", step,
                 dir.c_str(), e.what());
    return {};
  }
  return prefix + ".json";
}

InputVerdict StepEngine::check_inputs(const std::vector<at::Tensor>& inputs,
                                      const at::Tensor& mask) {
  auto checked = std::make_shared<forensics::InputCheck>(forensics::check_inputs(inputs, mask));
  if (replay_) forward_rng_ = checkpoint::capture_rng();  // closest to the forward pass
  input_check_ = checked;
  return InputVerdict([checked] { return checked->problems(); });
}

at::Tensor StepEngine::probe(const std::string& name, const at::Tensor& output) {
  // A replay's probes are its own: they name the first bad module of the replayed batch.
  if (replaying_) return replay_probes_.record(name, output);
  return probes_.record(name, output);
}

void StepEngine::watch_gradient(const at::Tensor& grad) {
  if (replaying_ || !grad.defined() || !at::isFloatingType(grad.scalar_type())) return;
  // Its sum is NaN/Inf when an element is (no bool copy of the gradient), or when finite
  // gradients sum past fp32's range (about 3e38: an exploding step by then). Accumulated in fp32
  // (a 16-bit gradient) or the gradient's own dtype, a read at memory speed: an fp64 sum casts
  // every element and cost 7-11x as much here. The step's sums add up in fp64, judged once
  // when the step packs its buffer.
  const at::ScalarType accumulate = grad.element_size() < 4 ? at::kFloat : grad.scalar_type();
  // Two ops a gradient: its sum, and an in-place add into the fp64 total (the add promotes, no
  // cast of its own).
  const at::Tensor sum = grad.detach().sum(accumulate);
  if (!watched_grad_sum_.defined()) {
    watched_grad_sum_ = sum.to(at::kDouble);
  } else if (watched_grad_sum_.device() == sum.device()) {
    watched_grad_sum_.add_(sum);
  } else {
    watched_grad_sum_.add_(sum.to(watched_grad_sum_.device()));
  }
}

void StepEngine::set_replay(forensics::Recompute recompute) {
  const bool first = !replay_;
  replay_ = std::move(recompute);
  if (first && replay_ && step_ == 0) forward_rng_ = checkpoint::capture_rng();
}

}  // namespace stepguard
