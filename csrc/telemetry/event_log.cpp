#include "csrc/telemetry/event_log.h"
#include "csrc/common/json_text.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace stepguard {
namespace telemetry {

namespace {
// JSON has no NaN/Inf: a non-finite number is written as null.
nlohmann::json number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }
}  // namespace

EventLog::EventLog(const std::string& path, bool every_step)
    : path_(path), every_step_(every_step), out_(path, std::ios::out | std::ios::trunc) {
  if (!out_) {
    throw std::runtime_error("stepguard: cannot open event log '" + path +
                             "' for writing: " + std::strerror(errno));
  }
}

std::string trace_line(const StepReport& report, const GlobalStats& stats, const Signals& signals,
                       const Decision& decision, const std::vector<std::string>& tensors) {
  nlohmann::json line;
  line["step"] = report.step;
  line["loss"] = number(report.loss);
  line["grad_norm"] = number(report.grad_norm);
  line["nonfinite"] = report.nonfinite_count;
  line["nan"] = stats.nan_count;
  line["inf"] = stats.inf_count;
  line["loss_nonfinite_ranks"] = stats.loss_nonfinite_ranks;
  if (!report.loss_given) line["loss_given"] = false;  // step() without a loss: null is not NaN
  line["loss_scale"] = number(report.loss_scale);
  line["lr_factor"] = number(report.lr_factor);
  line["outcome"] = to_string(report.outcome);
  nlohmann::json actions = nlohmann::json::array();
  for (Action a : report.actions) actions.push_back(to_string(a));
  line["actions"] = std::move(actions);
  line["batches_to_skip"] = report.batches_to_skip;
  if (report.rolled_back_to > 0) line["rolled_back_to"] = report.rolled_back_to;
  if (signals.any()) {
    nlohmann::json raised = nlohmann::json::array();
    for (Signal s : signals.raised) raised.push_back(to_string(s));
    line["signals"] = std::move(raised);
  }
  if (!decision.rules.empty()) line["rules"] = decision.rules;
  if (decision.has(Action::kClip)) line["clip_norm"] = number(decision.clip_norm);
  if (!decision.reason.empty()) line["reason"] = decision.reason;
  if (!stats.faulty_ranks.empty()) line["faulty_ranks"] = stats.faulty_ranks;
  if (!stats.diverged_replicas.empty()) line["diverged_replicas"] = stats.diverged_replicas;
  if (report.incident) {
    const Incident& incident = *report.incident;
    line["cause"] = to_string(incident.cause);
    if (!incident.ranks.empty()) line["origin_ranks"] = incident.ranks;
    if (!incident.rank_causes.empty()) {
      nlohmann::json causes = nlohmann::json::object();
      for (const RankCause& c : incident.rank_causes) {
        causes[std::to_string(c.rank)] = to_string(c.cause);
      }
      line["rank_causes"] = std::move(causes);
    }
  }
  if (!tensors.empty()) line["tensors"] = tensors;
  return dump_json(line);
}

void EventLog::record(const StepReport& report, const GlobalStats& stats, const Signals& signals,
                      const Decision& decision, const std::vector<std::string>& tensors) {
  const bool plain_apply = report.outcome == Outcome::kApplied && !report.incident.has_value();
  if (plain_apply && !every_step_) return;
  out_ << trace_line(report, stats, signals, decision, tensors) << '\n';
  out_.flush();
  if (!out_) throw std::runtime_error("stepguard: write to event log '" + path_ + "' failed");
}

}  // namespace telemetry
}  // namespace stepguard
