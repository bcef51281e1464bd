// StepEngine's record stage and its forensics: what this rank can tell about an incident
// (blame, evidence, replays, cause), the report and incident files, the trace and the metrics.
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include <cinttypes>
#include <cstdio>
#include <filesystem>

#include "csrc/checkpoint/disk_checkpoint.h"
#include "csrc/common/json_text.h"
#include "csrc/forensics/input_check.h"
#include "csrc/forensics/report.h"
#include "plugin/src/step_engine.h"

namespace stepguard {

StepEngine::Findings StepEngine::investigate(const Agreed& agreed, const StepDecision& decided) {
  Findings f;
  if (!decided.signals.any()) return f;
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
  forensics::Evidence& ev = f.evidence;
  ev.loss_nonfinite = g.loss_nonfinite_ranks > 0;
  ev.grads_nonfinite = g.nonfinite_count() > 0;
  ev.nan_count = g.nan_count;
  ev.inf_count = g.inf_count;
  ev.loss_spike =
      decided.signals.has(Signal::kLossSpike) || decided.signals.has(Signal::kLossRatio);
  ev.grad_norm_spike = decided.signals.has(Signal::kGradNormSpike);
  ev.bad_inputs = bad_inputs_;
  ev.blamed_grads = f.blamed;
  ev.loss_scaling = controller_.loss_scaling();
  ev.loss_scale = step_loss_scale_;
  ev.grad_norm = g.grad_norm;
  ev.loss = g.loss;
  for (const auto& h : history_) {
    ev.recent_grad_norms.push_back(h.grad_norm);
    ev.recent_losses.push_back(h.loss);
  }
  {
    at::NoGradGuard no_grad;
    const auto& params = port_.parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (!at::isfinite(params[i]).all().item<bool>()) ev.nonfinite_params.push_back(names[i]);
    }
  }
  probes_.fill(&ev);
  // Replays cost a few forward/backward passes: once per streak of bad steps, at its start.
  if (replay_ && (ev.loss_nonfinite || ev.grads_nonfinite) &&
      decided.signals.consecutive_bad_steps <= 1) {
    run_replays(&ev);
  }
  f.diagnosis = forensics::classify(ev);
  return f;
}

void StepEngine::run_replays(forensics::Evidence* ev) {
  replaying_ = true;
  // Replays must not move the training's random streams.
  const checkpoint::RngState training_rng = checkpoint::capture_rng();
  replay_scale_ = step_loss_scale_;  // "as is": the scale of the step, not the backed-off one
  forensics::run_replays(
      replay_, [this] { checkpoint::restore_rng(forward_rng_); }, port_.parameters(),
      controller_.loss_scaling(), ev);
  replay_scale_.reset();
  replaying_ = false;
  checkpoint::restore_rng(training_rng);
}

StepReport StepEngine::record(std::int64_t step, const Agreed& agreed, const StepDecision& decided,
                              const Findings& findings) {
  StepReport report = make_report(step, agreed.global, decided);
  report.incident = make_incident(step, agreed, decided, findings, report);
  if (report.incident) ++totals_.incidents;
  if (event_log_) {
    event_log_->record(report, agreed.global, decided.signals, decided.decision, findings.blamed);
  }
  if (metrics_) {
    if (report.incident) metrics_->record_cause(report.incident->cause);
    metrics_->record_step(report, decided.signals.consecutive_bad_steps, agreed.inspect_seconds,
                          agreed.agree_seconds);
  }
  history_.push_back({step, agreed.global.loss, agreed.global.grad_norm, report.loss_scale,
                      report.lr_factor, report.outcome});
  while (history_.size() > kHistory) history_.pop_front();
  bad_inputs_.clear();
  checked_inputs_.clear();
  probes_.clear();
  if (replay_) forward_rng_ = checkpoint::capture_rng();  // for the next step's replays
  return report;
}

std::optional<Incident> StepEngine::make_incident(std::int64_t step, const Agreed& agreed,
                                                  const StepDecision& decided,
                                                  const Findings& findings,
                                                  const StepReport& report) {
  if (!decided.signals.any()) return std::nullopt;
  Incident incident;
  incident.step = step;
  incident.signal = decided.signals.raised.front();
  incident.action = strongest_action(decided.decision.actions);
  incident.tensors = findings.blamed;
  incident.ranks = agreed.global.faulty_ranks;
  incident.reason = decided.decision.reason;
  incident.cause = findings.diagnosis.cause;
  incident.evidence = findings.diagnosis.evidence;
  incident.fixes = findings.diagnosis.fixes;
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
  const std::string prefix = dir + "/" + rank_prefix + name;
  try {
    fs::create_directories(dir);
    if (!checked_inputs_.empty()) {
      std::vector<torch::Tensor> host;
      for (const auto& t : checked_inputs_) host.push_back(t.to(at::kCPU));
      torch::save(host, prefix + ".batch.pt");
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

bool StepEngine::check_inputs(const std::vector<at::Tensor>& inputs, const at::Tensor& mask) {
  forensics::InputCheck checked = forensics::check_inputs(inputs, mask);
  if (replay_) forward_rng_ = checkpoint::capture_rng();  // closest to the forward pass
  bad_inputs_ = std::move(checked.problems);
  checked_inputs_ = std::move(checked.inputs);
  return bad_inputs_.empty();
}

at::Tensor StepEngine::probe(const std::string& name, const at::Tensor& output) {
  if (replaying_) return output;  // replays do not add records
  return probes_.record(name, output);
}

void StepEngine::set_replay(forensics::Recompute recompute) {
  const bool first = !replay_;
  replay_ = std::move(recompute);
  if (first && replay_ && step_ == 0) forward_rng_ = checkpoint::capture_rng();
}

}  // namespace stepguard
