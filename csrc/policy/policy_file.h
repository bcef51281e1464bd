/*
 * Policy files: the YAML a user writes per run, read into a PolicyConfig. Schema version 1 holds
 * the limits of the built-in ladder; the rules and detectors of the full engine extend it.
 *
 * Errors name the file, line and column (1-based) and carry a fixed message text, in the
 * yaml-cpp style: `policy.yaml:4:3: unknown key 'max_consecutiv_bad_steps' (did you mean
 * 'max_consecutive_bad_steps'?)`. Every error in a file is reported, not only the first.
 */
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "csrc/policy/policy.h"

namespace stepguard {
namespace policy {

/// The schema version this build reads.
constexpr int kPolicySchemaVersion = 1;

/// One problem in a policy file, at a 1-based line and column (0 when unknown).
struct PolicyIssue {
  std::string file;
  int line = 0;
  int column = 0;
  std::string message;
  /// "file:line:col: message", or "file: message" without a line.
  std::string format() const;
};

/// Thrown by load_policy_file; what() holds every issue, one formatted line each.
class PolicyFileError : public std::runtime_error {
 public:
  explicit PolicyFileError(std::vector<PolicyIssue> issues);
  const std::vector<PolicyIssue>& issues() const noexcept { return issues_; }

 private:
  std::vector<PolicyIssue> issues_;
};

/// Parses policy text; `name` is used in issues. Returns the issues found (empty when valid) and
/// fills `config` only when there are none.
std::vector<PolicyIssue> parse_policy(const std::string& text, const std::string& name,
                                      PolicyConfig* config);

/// Reads and parses a policy file; a file that cannot be read is one issue at line 0. A `path`
/// that names no file but a shipped preset (`default`, `megatron`, ...: presets.h) reads the
/// preset, its issues naming "preset 'NAME'"; a bare name (no '/', no '.') that is neither is
/// one issue naming the presets.
std::vector<PolicyIssue> check_policy_file(const std::string& path, PolicyConfig* config);

/// Reads a policy file or preset (as check_policy_file) or throws PolicyFileError.
PolicyConfig load_policy_file(const std::string& path);

/// The policy's ladder in plain words, one step per line.
std::string explain_policy(const PolicyConfig& config);

}  // namespace policy
}  // namespace stepguard
