/*
 * The incident report: one JSON document per incident (what `stepguard incident show` reads) and
 * its Markdown rendering for people. The guard fills the JSON; this file only renders it.
 *
 * Fields: step, signal, action, cause, evidence[], fixes[], tensors[] (backward order), ranks[],
 * reason, replay{rerun, fp32, anomaly_op}, history[{step, loss, grad_norm, loss_scale,
 * lr_factor, outcome}], batch (path of the saved batch, if any), picture (path of the picture of
 * the steps around the incident, beside the report; linked by its file name).
 */
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace stepguard {
namespace forensics {

/// Markdown for a report; tolerates missing fields (they are left out).
std::string render_markdown(const nlohmann::json& report);

}  // namespace forensics
}  // namespace stepguard
