#include "stepguard/tools.h"

#include <nlohmann/json.hpp>
#include <stdexcept>

#include "csrc/checkpoint/disk_checkpoint.h"
#include "csrc/common/json_text.h"
#include "csrc/forensics/report.h"
#include "csrc/policy/policy_file.h"

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

std::vector<CheckpointStatus> verify_checkpoints(const std::string& root) {
  std::vector<CheckpointStatus> out;
  for (const auto& r : checkpoint::verify_all(root)) {
    out.push_back(CheckpointStatus{r.entry.dir, r.entry.step, r.entry.world_size, r.entry.run,
                                   r.bytes, r.complete, r.problems});
  }
  return out;
}

std::string render_incident_report(const std::string& json_text, const std::string& source) {
  nlohmann::json report;
  try {
    report = parse_json_bounded(json_text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(source + ": not an incident report (" + e.what() + ")");
  }
  if (!report.is_object() || !report.contains("step") || !report.contains("cause")) {
    throw std::invalid_argument(source + ": not an incident report (no 'step' and 'cause')");
  }
  std::string text;
  try {
    text = forensics::render_markdown(report);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(
        source + ": not an incident report (a field has the wrong type: " + e.what() + ")");
  }
  // The report is data from a file: no terminal escape sequences reach the terminal.
  for (char& c : text) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\n' && c != '\t') || u == 0x7f) c = '?';
  }
  return text;
}

}  // namespace stepguard
