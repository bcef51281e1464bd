#include "csrc/policy/policy_file.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace stepguard {
namespace policy {

namespace {

// Keys of schema version 1, by section.
const std::vector<std::string> kTopKeys = {"version", "limits", "loss_scale"};
const std::vector<std::string> kLossScaleKeys = {
    "enabled",         "init_scale", "growth_factor", "backoff_factor",
    "growth_interval", "hysteresis", "min_scale"};
const std::vector<std::string> kLimitKeys = {"max_consecutive_bad_steps"};

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

class Checker {
 public:
  explicit Checker(std::string name) : name_(std::move(name)) {}

  void issue(const YAML::Mark& mark, const std::string& message) {
    issues_.push_back(
        {name_, mark.is_null() ? 0 : mark.line + 1, mark.is_null() ? 0 : mark.column + 1, message});
  }

  // Reports keys of `map` not in `known`, suggesting the closest known key.
  void check_keys(const YAML::Node& map, const std::vector<std::string>& known,
                  const std::string& where) {
    for (const auto& item : map) {
      const std::string key = item.first.Scalar();
      if (std::find(known.begin(), known.end(), key) != known.end()) continue;
      std::string best;
      std::size_t best_distance = std::max<std::size_t>(2, key.size() / 3) + 1;
      for (const auto& k : known) {
        const std::size_t d = edit_distance(key, k);
        if (d < best_distance) {
          best = k;
          best_distance = d;
        }
      }
      issue(item.first.Mark(), "unknown key '" + key + "'" + where +
                                   (best.empty() ? "" : " (did you mean '" + best + "'?)"));
    }
  }

  bool whole_number(const YAML::Node& node, const std::string& key, long long lo, long long hi,
                    long long* out) {
    if (node.IsScalar()) {
      const std::string& s = node.Scalar();
      errno = 0;
      char* end = nullptr;
      const long long v = std::strtoll(s.c_str(), &end, 10);
      if (!s.empty() && errno == 0 && end == s.c_str() + s.size() && v >= lo && v <= hi) {
        *out = v;
        return true;
      }
    }
    std::ostringstream msg;
    msg << "'" << key << "' must be a whole number in [" << lo << ", " << hi << "], got "
        << (node.IsScalar() ? "'" + node.Scalar() + "'"
                            : std::string("a ") + (node.IsMap() ? "map" : "list"));
    issue(node.Mark(), msg.str());
    return false;
  }

  bool number(const YAML::Node& node, const std::string& key, double lo, double hi, bool open_lo,
              bool open_hi, double* out) {
    if (node.IsScalar()) {
      const std::string& s = node.Scalar();
      errno = 0;
      char* end = nullptr;
      const double v = std::strtod(s.c_str(), &end);
      const bool above = open_lo ? v > lo : v >= lo;
      const bool below = open_hi ? v < hi : v <= hi;
      if (!s.empty() && errno == 0 && end == s.c_str() + s.size() && std::isfinite(v) && above &&
          below) {
        *out = v;
        return true;
      }
    }
    std::ostringstream msg;
    msg << "'" << key << "' must be a number in " << (open_lo ? "(" : "[") << lo << ", " << hi
        << (open_hi ? ")" : "]") << ", got "
        << (node.IsScalar() ? "'" + node.Scalar() + "'"
                            : std::string("a ") + (node.IsMap() ? "map" : "list"));
    issue(node.Mark(), msg.str());
    return false;
  }

  bool boolean(const YAML::Node& node, const std::string& key, bool* out) {
    if (node.IsScalar() && (node.Scalar() == "true" || node.Scalar() == "false")) {
      *out = node.Scalar() == "true";
      return true;
    }
    issue(node.Mark(),
          "'" + key + "' must be true or false, got " +
              (node.IsScalar() ? "'" + node.Scalar() + "'" : std::string("a map or list")));
    return false;
  }

  std::vector<PolicyIssue> take() { return std::move(issues_); }

 private:
  std::string name_;
  std::vector<PolicyIssue> issues_;
};

}  // namespace

std::string PolicyIssue::format() const {
  std::ostringstream out;
  out << file << ":" << line << ":" << column << ": " << message;
  return out.str();
}

PolicyFileError::PolicyFileError(std::vector<PolicyIssue> issues)
    : std::runtime_error([&] {
        std::string text;
        for (const auto& i : issues) text += (text.empty() ? "" : "\n") + i.format();
        return text;
      }()),
      issues_(std::move(issues)) {}

std::vector<PolicyIssue> parse_policy(const std::string& text, const std::string& name,
                                      PolicyConfig* config) {
  Checker check(name);
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    check.issue(e.mark, "YAML syntax error: " + e.msg);
    return check.take();
  }
  if (!root.IsMap()) {
    check.issue(root.IsNull() ? YAML::Mark() : root.Mark(),  // an empty file: 1:1
                "a policy must be a map with at least 'version: " +
                    std::to_string(kPolicySchemaVersion) + "'");
    return check.take();
  }
  check.check_keys(root, kTopKeys, "");
  PolicyConfig parsed;
  if (const YAML::Node version = root["version"]; !version) {
    check.issue(root.Mark(), "missing required key 'version' (this stepguard reads version " +
                                 std::to_string(kPolicySchemaVersion) + ")");
  } else {
    long long v = 0;
    if (check.whole_number(version, "version", 1, 1000000, &v) && v != kPolicySchemaVersion) {
      check.issue(version.Mark(), "unsupported schema version " + std::to_string(v) +
                                      " (this stepguard reads version " +
                                      std::to_string(kPolicySchemaVersion) + ")");
    }
  }
  if (const YAML::Node limits = root["limits"]; limits) {
    if (!limits.IsMap()) {
      check.issue(limits.Mark(), "'limits' must be a map");
    } else {
      check.check_keys(limits, kLimitKeys, " in 'limits'");
      if (const YAML::Node n = limits["max_consecutive_bad_steps"]; n) {
        long long v = 0;
        if (check.whole_number(n, "max_consecutive_bad_steps", 0, 1000000000, &v)) {
          parsed.max_consecutive_bad_steps = v;
        }
      }
    }
  }
  if (const YAML::Node ls = root["loss_scale"]; ls) {
    if (!ls.IsMap()) {
      check.issue(ls.Mark(), "'loss_scale' must be a map");
    } else {
      check.check_keys(ls, kLossScaleKeys, " in 'loss_scale'");
      parsed.has_loss_scale = true;
      LossScaleSettings& l = parsed.loss_scale;
      l.enabled = true;  // a loss_scale section turns scaling on unless it says enabled: false
      if (const YAML::Node n = ls["enabled"]; n) check.boolean(n, "enabled", &l.enabled);
      if (const YAML::Node n = ls["init_scale"]; n) {
        check.number(n, "init_scale", 0, 1e38, true, false, &l.init_scale);
      }
      if (const YAML::Node n = ls["growth_factor"]; n) {
        check.number(n, "growth_factor", 1, 1e6, true, false, &l.growth_factor);
      }
      if (const YAML::Node n = ls["backoff_factor"]; n) {
        check.number(n, "backoff_factor", 0, 1, true, true, &l.backoff_factor);
      }
      long long v = 0;
      if (const YAML::Node n = ls["growth_interval"]; n) {
        if (check.whole_number(n, "growth_interval", 1, 1000000000, &v)) l.growth_interval = v;
      }
      if (const YAML::Node n = ls["hysteresis"]; n) {
        if (check.whole_number(n, "hysteresis", 1, 1000000, &v)) l.hysteresis = v;
      }
      if (const YAML::Node n = ls["min_scale"]; n) {
        if (check.number(n, "min_scale", 0, 1e38, false, false, &l.min_scale) &&
            l.min_scale > l.init_scale) {
          check.issue(n.Mark(), "'min_scale' " + n.Scalar() + " is above 'init_scale'");
        }
      }
    }
  }
  std::vector<PolicyIssue> issues = check.take();
  if (issues.empty() && config != nullptr) *config = parsed;
  return issues;
}

std::vector<PolicyIssue> check_policy_file(const std::string& path, PolicyConfig* config) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return {{path, 0, 0, "cannot read policy file: it is a directory"}};
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return {{path, 0, 0, std::string("cannot read policy file: ") + std::strerror(errno)}};
  }
  std::ostringstream text;
  text << in.rdbuf();
  return parse_policy(text.str(), path, config);
}

PolicyConfig load_policy_file(const std::string& path) {
  PolicyConfig config;
  auto issues = check_policy_file(path, &config);
  if (!issues.empty()) throw PolicyFileError(std::move(issues));
  return config;
}

std::string explain_policy(const PolicyConfig& config) {
  std::ostringstream out;
  out << "On every step, all gradients and the loss are checked for NaN/Inf.\n";
  out << "1. Clean step: the optimizer steps.\n";
  out << "2. Any NaN/Inf gradient or loss, on any rank: the batch is skipped (gradients zeroed, "
         "parameters and optimizer state untouched).\n";
  if (config.has_loss_scale && config.loss_scale.enabled) {
    const LossScaleSettings& l = config.loss_scale;
    out << "Loss scaling (fp16): start at " << l.init_scale << "; on a NaN/Inf step multiply by "
        << l.backoff_factor;
    if (l.hysteresis > 1) out << " after " << l.hysteresis << " such steps";
    out << "; after " << l.growth_interval << " clean steps multiply by " << l.growth_factor;
    if (l.min_scale > 0) out << "; never below " << l.min_scale;
    out << ".\n";
  }
  if (config.max_consecutive_bad_steps > 0) {
    out << "3. " << config.max_consecutive_bad_steps
        << " bad steps in a row: training is aborted.\n";
  } else {
    out << "3. No limit on bad steps in a row: skipping continues for as long as steps are bad.\n";
  }
  return out.str();
}

}  // namespace policy
}  // namespace stepguard
