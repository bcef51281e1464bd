#include "csrc/forensics/report.h"
#include "csrc/common/json_text.h"

#include <cstdio>
#include <filesystem>
#include <sstream>

namespace stepguard {
namespace forensics {

namespace {

std::string text(const nlohmann::json& j, const char* key, const std::string& fallback = "") {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  return it->is_string() ? it->get<std::string>() : it->dump();
}

std::string cell(const nlohmann::json& v) {
  if (v.is_null()) return "NaN/Inf";
  if (v.is_number_float()) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6g", v.get<double>());
    return buf;
  }
  return v.is_string() ? v.get<std::string>() : dump_json(v);
}

}  // namespace

std::string render_markdown(const nlohmann::json& r) {
  std::ostringstream out;
  out << "# Incident at step " << text(r, "step", "?") << ": " << text(r, "cause", "unknown")
      << "\n\n";
  out << "- signal: `" << text(r, "signal") << "`\n";
  out << "- action: `" << text(r, "action") << "`\n";
  if (r.contains("reason")) out << "- policy: " << text(r, "reason") << "\n";
  if (r.contains("ranks") && !r["ranks"].empty())
    out << "- ranks: " << dump_json(r["ranks"]) << "\n";
  if (r.value("origin_unknown", false))
    out << "- ranks: unknown (gradients reduced into shards before the guard saw them)\n";
  if (r.contains("tensors") && !r["tensors"].empty()) {
    out << "- first offending gradients (backward order):";
    for (const auto& t : r["tensors"]) out << " `" << t.get<std::string>() << "`";
    out << "\n";
  }
  if (r.contains("batch")) out << "- batch saved for replay: `" << text(r, "batch") << "`\n";
  if (!text(r, "picture").empty()) {
    // The picture lies beside the report: a link by its file name still works when the
    // directory moves.
    out << "\n![steps around the incident]("
        << std::filesystem::path(text(r, "picture")).filename().string() << ")\n";
  }
  out << "\n## Why: " << text(r, "cause", "unknown") << "\n\n";
  for (const auto& e : r.value("evidence", nlohmann::json::array())) {
    out << "- " << e.get<std::string>() << "\n";
  }
  if (r.contains("replay")) {
    const auto& p = r["replay"];
    out << "\nReplays of the batch: as is: " << text(p, "rerun", "not run")
        << "; in fp32: " << text(p, "fp32", "not run");
    if (!text(p, "anomaly_op").empty()) out << "; anomaly mode: " << text(p, "anomaly_op");
    out << "\n";
  }
  out << "\n## Try first\n\n";
  int i = 0;
  for (const auto& f : r.value("fixes", nlohmann::json::array())) {
    out << ++i << ". " << f.get<std::string>() << "\n";
  }
  const auto history = r.value("history", nlohmann::json::array());
  if (!history.empty()) {
    out << "\n## The last " << history.size() << " steps\n\n";
    out << "| step | loss | grad norm | loss scale | lr factor | outcome |\n";
    out << "|---|---|---|---|---|---|\n";
    for (const auto& h : history) {
      out << "| " << cell(h.value("step", nlohmann::json())) << " | "
          << cell(h.value("loss", nlohmann::json())) << " | "
          << cell(h.value("grad_norm", nlohmann::json())) << " | "
          << cell(h.value("loss_scale", nlohmann::json())) << " | "
          << cell(h.value("lr_factor", nlohmann::json())) << " | "
          << cell(h.value("outcome", nlohmann::json())) << " |\n";
    }
  }
  return out.str();
}

}  // namespace forensics
}  // namespace stepguard
