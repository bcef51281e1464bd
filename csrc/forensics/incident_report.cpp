#include "csrc/forensics/incident_report.h"

#include <cmath>

namespace stepguard {
namespace forensics {

namespace {

using Json = nlohmann::json;

const char* replay_word(ReplayResult r) {
  return r == ReplayResult::kNotRun       ? "not run"
         : r == ReplayResult::kReproduced ? "non-finite again"
                                          : "finite";
}

// JSON has no NaN/Inf: a non-finite number is null.
Json number(double v) { return std::isfinite(v) ? Json(v) : Json(); }

Json history_json(const std::vector<HistoryRow>& history) {
  Json out = Json::array();
  for (const auto& h : history) {
    out.push_back({{"step", h.step},
                   {"loss", number(h.loss)},
                   {"grad_norm", number(h.grad_norm)},
                   {"loss_scale", number(h.loss_scale)},
                   {"lr_factor", number(h.lr_factor)},
                   {"outcome", to_string(h.outcome)}});
  }
  return out;
}

}  // namespace

Json incident_json(const Incident& incident, int rank, const std::vector<Action>& actions,
                   const Evidence& evidence, const std::vector<HistoryRow>& history) {
  Json r = {{"step", incident.step},
            {"signal", to_string(incident.signal)},
            {"action", to_string(incident.action)},
            {"cause", to_string(incident.cause)},
            {"evidence", incident.evidence},
            {"fixes", incident.fixes},
            {"tensors", incident.tensors},
            {"ranks", incident.ranks},
            {"origin_unknown", incident.origin_unknown},
            {"rank", rank},
            {"reason", incident.reason}};
  Json names = Json::array();
  for (Action a : actions) names.push_back(to_string(a));
  r["actions"] = names;
  Json causes = Json::object();
  for (const RankCause& c : incident.rank_causes) {
    causes[std::to_string(c.rank)] = to_string(c.cause);
  }
  r["rank_causes"] = causes;
  r["replay"] = {{"rerun", replay_word(evidence.rerun)},
                 {"fp32", replay_word(evidence.fp32)},
                 {"anomaly_op", evidence.anomaly_op}};
  if (!evidence.anomaly_message.empty()) r["replay"]["message"] = evidence.anomaly_message;
  if (!evidence.anomaly_traceback.empty()) r["replay"]["traceback"] = evidence.anomaly_traceback;
  if (!evidence.nonfinite_params.empty()) r["nonfinite_params"] = evidence.nonfinite_params;
  if (!evidence.first_bad_forward.empty() || !evidence.first_bad_backward.empty()) {
    r["probes"] = {{"first_bad_forward", evidence.first_bad_forward},
                   {"first_bad_backward", evidence.first_bad_backward}};
  }
  r["history"] = history_json(history);
  return r;
}

}  // namespace forensics
}  // namespace stepguard
