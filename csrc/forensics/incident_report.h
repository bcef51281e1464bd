/*
 * The incident report's JSON document: one place that knows its schema (what
 * `stepguard incident show` and render_markdown() read).
 *
 * Fields: step, signal, action, actions[], cause, evidence[], fixes[], tensors[] (backward order),
 * ranks[], rank, reason, replay{rerun, fp32, anomaly_op, message}, nonfinite_params[],
 * probes{first_bad_forward, first_bad_backward}, history[{step, loss, grad_norm, loss_scale,
 * lr_factor, outcome}], batch (path of the saved batch, added by the writer), picture (path of
 * the picture of the steps around the incident, added by attach_incident_picture in tools.h).
 *
 * Not here: writing files (the engine's record stage). Thread-compatible.
 */
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "csrc/core/report.h"
#include "csrc/forensics/classifier.h"

namespace stepguard {
namespace forensics {

/// One step of the history a report shows around its incident.
struct HistoryRow {
  std::int64_t step = 0;
  double loss = 0.0;
  double grad_norm = 0.0;
  double loss_scale = 1.0;
  double lr_factor = 1.0;
  Outcome outcome = Outcome::kApplied;
};

/// The report of `incident` as seen on `rank`: what the step decided (`actions`), the evidence
/// and the steps before it (`history`, oldest first, this step last).
nlohmann::json incident_json(const Incident& incident, int rank, const std::vector<Action>& actions,
                             const Evidence& evidence, const std::vector<HistoryRow>& history);

}  // namespace forensics
}  // namespace stepguard
