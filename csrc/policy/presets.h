/*
 * The policy presets shipped in configs/policies (default, megatron, deepspeed-fp16, ...), built
 * into the library so that a preset's name works wherever a policy file's path does, from any
 * working directory and in an installed package. Only the texts: parsing is policy_file.h's.
 */
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace stepguard {
namespace policy {

/// Every preset as (name, YAML text), by name. The name is the file's stem.
const std::vector<std::pair<std::string, std::string>>& policy_presets();

/// The text of preset `name`, or nullptr when there is none.
const std::string* find_policy_preset(const std::string& name);

/// The preset names, comma-separated, for messages.
std::string policy_preset_names();

/// " (did you mean 'default'?)" for a misspelt preset name, else "".
std::string preset_suggestion(const std::string& name);

/// Whether `policy`, as a user gives it (GuardOptions::policy, a CLI argument), was meant as a
/// preset's name: no file of that name exists and it is a bare word (no '/', no '.'). A path
/// that names no file is a file's error, not a preset's.
bool meant_as_preset(const std::string& policy);

}  // namespace policy
}  // namespace stepguard
