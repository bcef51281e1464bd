#include "csrc/policy/presets.h"

#include <filesystem>
#include <system_error>

#include "csrc/policy/policy_file_internal.h"

namespace stepguard {
namespace policy {

const std::vector<std::pair<std::string, std::string>>& policy_presets() {
  // Generated from configs/policies/*.yaml at configure time (csrc/CMakeLists.txt).
  static const std::vector<std::pair<std::string, std::string>> presets = {
#include "policy_presets.inc"
  };
  return presets;
}

const std::string* find_policy_preset(const std::string& name) {
  for (const auto& [preset, text] : policy_presets()) {
    if (preset == name) return &text;
  }
  return nullptr;
}

std::string policy_preset_names() {
  std::string out;
  for (const auto& preset : policy_presets()) {
    if (!out.empty()) out += ", ";
    out += preset.first;
  }
  return out;
}

std::string preset_suggestion(const std::string& name) {
  std::vector<std::string> names;
  for (const auto& preset : policy_presets()) names.push_back(preset.first);
  return detail::did_you_mean(name, names);
}

bool meant_as_preset(const std::string& policy) {
  std::error_code error;
  return !policy.empty() && policy.find_first_of("/.") == std::string::npos &&
         !std::filesystem::exists(policy, error);
}

}  // namespace policy
}  // namespace stepguard
