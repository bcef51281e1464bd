#include "stepguard/tools.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "csrc/checkpoint/disk_checkpoint.h"
#include "csrc/common/json_text.h"
#include "csrc/common/safe_file.h"
#include "csrc/forensics/report.h"
#include "csrc/policy/policy_file.h"
#include "csrc/policy/presets.h"

namespace stepguard {

std::vector<std::string> check_policy_file(const std::string& path) {
  std::vector<std::string> out;
  for (const auto& issue : policy::check_policy_file(path, nullptr)) out.push_back(issue.format());
  return out;
}

std::string explain_policy_file(const std::string& path) {
  policy::PolicyConfig config;
  const auto issues = policy::check_policy_file(path, &config);
  if (!issues.empty()) throw std::invalid_argument(policy::PolicyFileError(issues).what());
  return policy::explain_policy(config);
}

std::vector<std::string> policy_preset_names() {
  std::vector<std::string> out;
  for (const auto& preset : policy::policy_presets()) out.push_back(preset.first);
  return out;
}

std::string policy_preset_text(const std::string& name) {
  if (const std::string* text = policy::find_policy_preset(name)) return *text;
  throw std::invalid_argument("no shipped policy preset '" + name +
                              "' (presets: " + policy::policy_preset_names() + ")");
}

std::vector<CheckpointStatus> verify_checkpoints(const std::string& root) {
  std::vector<CheckpointStatus> out;
  for (const auto& r : checkpoint::verify_all(root)) {
    out.push_back(CheckpointStatus{r.entry.dir, r.entry.step, r.entry.world_size, r.entry.run,
                                   r.bytes, r.complete, r.problems});
  }
  return out;
}

namespace {

// Reports are a few kilobytes; evidence and tensor lists are bounded by the writer.
constexpr std::int64_t kMaxReportBytes = std::int64_t{16} << 20;

nlohmann::json parse_incident_report(const std::string& json_text, const std::string& source) {
  nlohmann::json report;
  try {
    report = parse_json_bounded(json_text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(source + ": not an incident report (" + e.what() + ")");
  }
  if (!report.is_object() || !report.contains("step") || !report.contains("cause")) {
    throw std::invalid_argument(source + ": not an incident report (no 'step' and 'cause')");
  }
  return report;
}

std::string markdown_of(const nlohmann::json& report, const std::string& source) {
  try {
    return forensics::render_markdown(report);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(
        source + ": not an incident report (a field has the wrong type: " + e.what() + ")");
  }
}

}  // namespace

std::string render_incident_report(const std::string& json_text, const std::string& source) {
  std::string text = markdown_of(parse_incident_report(json_text, source), source);
  // The report is data from a file: no terminal escape sequences reach the terminal.
  for (char& c : text) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\n' && c != '\t') || u == 0x7f) c = '?';
  }
  return text;
}

std::string render_incident_report_file(const std::string& path) {
  std::string text, why;
  if (!read_regular_file(path, kMaxReportBytes, &text, &why)) {
    throw std::invalid_argument(path + ": cannot read: " + why);
  }
  return render_incident_report(text, path);
}

void attach_incident_picture(const std::string& report_path, const std::string& picture_path) {
  std::string text, why;
  if (!read_regular_file(report_path, kMaxReportBytes, &text, &why)) {
    throw std::invalid_argument(report_path + ": cannot read: " + why);
  }
  nlohmann::json report = parse_incident_report(text, report_path);
  report["picture"] = picture_path;
  const std::string markdown = markdown_of(report, report_path);
  // As the guard writes them: the JSON, then its Markdown beside it.
  checkpoint::write_file_atomically(report_path, dump_json(report, 2) + "\n");
  checkpoint::write_file_atomically(
      std::filesystem::path(report_path).replace_extension(".md").string(), markdown);
}

}  // namespace stepguard
