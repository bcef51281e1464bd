// Checks of a policy file: each value against its type and range and each key against the schema
// (Checker), then settings that contradict each other and rules or limits that can never fire or
// never take effect. Where values go is policy_reader.cpp's; wording helpers are
// policy_messages.cpp's.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "csrc/policy/policy_file_internal.h"

namespace stepguard {
namespace policy {
namespace detail {

namespace {

// Configured under 'detectors' but disabled, yet a rule relies on it.
namespace {
// Whether `name` is a trend detector the policy turned off.
bool trend_off(const std::string& name, const DetectorSettings& d) {
  const std::vector<TrendKind>& kinds = trend_kinds();
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    if (name == kinds[i].key) return !d.trends[i].enabled;
  }
  return false;
}
}  // namespace

void check_detector_uses(const PolicyConfig& config, const PolicyMarks& marks, Checker* check) {
  const DetectorSettings& d = config.detectors;
  for (const auto& use : marks.detector_uses) {
    const std::string& name = use.detector;
    if (std::find(marks.configured_detectors.begin(), marks.configured_detectors.end(), name) ==
        marks.configured_detectors.end()) {
      continue;  // used but not configured: the reader turned it on with its defaults
    }
    if ((name == "loss_spike" && !d.loss_spike.enabled) ||
        (name == "grad_norm_spike" && !d.grad_norm_spike.enabled) ||
        (name == "loss_ratio" && !d.loss_ratio.enabled) ||
        (name == "loss_recovery" && !d.loss_recovery.enabled) || trend_off(name, d)) {
      check->issue(use.mark, use.user + " can never fire: 'detectors." + name + "' is disabled");
    }
  }
  // The recovery watch starts at a loss spike: without a loss detector it never starts.
  if (d.loss_recovery.enabled && !d.loss_spike.enabled && !d.loss_ratio.enabled) {
    for (const auto& use : marks.detector_uses) {
      if (use.detector != "loss_recovery") continue;
      check->issue(use.mark, use.user +
                                 " can never fire: 'loss_not_recovered' follows a loss spike, and "
                                 "neither 'detectors.loss_spike' nor 'detectors.loss_ratio' is on");
    }
  }
}

// `spike` listens to the detectors that are on; it turns none on by itself.
void check_spike_rules(const PolicyConfig& config, const PolicyMarks& marks, Checker* check) {
  SignalSet detecting = 0;
  if (config.detectors.loss_spike.enabled) detecting |= bit(Signal::kLossSpike);
  if (config.detectors.grad_norm_spike.enabled) detecting |= bit(Signal::kGradNormSpike);
  if (config.detectors.loss_ratio.enabled) detecting |= bit(Signal::kLossRatio);
  for (const auto& [index, mark] : marks.rule_on) {
    const Rule& rule = config.rules[index];
    if (rule.on == kSpikeSignals && (rule.on & detecting) == 0) {
      check->issue(mark, "rule '" + rule.name +
                             "' can never fire: no spike detector is on (configure one under "
                             "'detectors')");
    }
  }
}

// Actions and limits that need a setting elsewhere in the file.
void check_needed_settings(const YAML::Node& root, const PolicyConfig& config,
                           const PolicyMarks& marks, Checker* check) {
  const bool rollback = config.uses(Action::kRollback);
  if (rollback && config.checkpoint.snapshot_every == 0) {
    const YAML::Mark m =
        !marks.rollback_actions.empty() ? marks.rollback_actions.front() : root.Mark();
    check->issue(m, "'rollback' needs RAM snapshots: set 'checkpoint.snapshot_every'");
  }
  if (config.limits.max_rollbacks.enabled && !rollback) {
    check->issue(marks.max_rollbacks,
                 "'limits.max_rollbacks' can never fire: no rule or limit rolls back");
  }
  if (config.limits.loss_scale_floor_steps > 0 &&
      !(config.has_loss_scale && config.loss_scale.enabled && config.loss_scale.min_scale > 0)) {
    check->issue(marks.loss_scale_floor,
                 "'limits.loss_scale_floor' can never fire: set 'loss_scale.min_scale' above 0");
  }
}

}  // namespace

void Checker::issue(const YAML::Mark& mark, const std::string& message) {
  issues_.push_back(
      {name_, mark.is_null() ? 0 : mark.line + 1, mark.is_null() ? 0 : mark.column + 1, message});
}

void Checker::check_keys(const YAML::Node& map, const std::vector<std::string>& known,
                         const std::string& where, const std::vector<std::string>& elsewhere,
                         const std::string& why) {
  // A repeated key would be read once (the first) and the edit to the other silently ignored.
  std::map<std::string, YAML::Mark> seen;
  for (const auto& item : map) {
    const std::string key = item.first.IsScalar() ? item.first.Scalar() : std::string();
    if (item.first.IsScalar()) {
      const auto [first, fresh] = seen.emplace(key, item.first.Mark());
      if (!fresh) {
        issue(item.first.Mark(), "duplicate key '" + key + "'" + where + " (first given at line " +
                                     std::to_string(first->second.line + 1) + ", column " +
                                     std::to_string(first->second.column + 1) + ")");
        continue;
      }
    }
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    if (!why.empty() && std::find(elsewhere.begin(), elsewhere.end(), key) != elsewhere.end()) {
      issue(item.first.Mark(), "'" + key + "' " + why);
      continue;
    }
    if (!item.first.IsScalar()) {
      issue(item.first.Mark(), "a key must be a plain word" + where);
      continue;
    }
    // No near spelling: the keys that are known there, from the schema.
    std::string hint = did_you_mean(key, known);
    if (hint.empty() && !known.empty()) hint = " (known: " + join(known) + ")";
    issue(item.first.Mark(), "unknown key '" + key + "'" + where + hint);
  }
}

bool Checker::map(const YAML::Node& node, const std::string& key) {
  if (node.IsMap()) return true;
  issue(node.Mark(), "'" + key + "' must be a map");
  return false;
}

bool Checker::whole_number(const YAML::Node& node, const std::string& key, long long lo,
                           long long hi, long long* out) {
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
      << describe(node);
  issue(node.Mark(), msg.str());
  return false;
}

bool Checker::number(const YAML::Node& node, const std::string& key, double lo, double hi,
                     bool open_lo, bool open_hi, double* out) {
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
      << (open_hi ? ")" : "]") << ", got " << describe(node);
  issue(node.Mark(), msg.str());
  return false;
}

bool Checker::boolean(const YAML::Node& node, const std::string& key, bool* out) {
  if (node.IsScalar() && (node.Scalar() == "true" || node.Scalar() == "false")) {
    *out = node.Scalar() == "true";
    return true;
  }
  issue(node.Mark(), "'" + key + "' must be true or false, got " + describe(node));
  return false;
}

void check_min_scale(const YAML::Node& node, const LossScaleSettings& scale, Checker* check) {
  if (scale.min_scale > scale.init_scale) {
    check->issue(node.Mark(), "'min_scale' " + node.Scalar() + " is above 'init_scale'");
  }
}

void check_within(const Rule& rule, const YAML::Node& steps, const YAML::Node& count,
                  Checker* check) {
  if (rule.within_count > rule.within_steps) {
    check->issue(count.Mark(), "rule '" + rule.name + "' can never fire: 'count' " +
                                   count.Scalar() + " is more than the window of " +
                                   steps.Scalar() + " steps");
  }
}

void check_clip(const Rule& rule, const YAML::Mark& action, Checker* check) {
  if (rule.action.type == Action::kClip && rule.on != 0 && (rule.on & ~kNonfiniteSignals) == 0) {
    check->issue(action, "rule '" + rule.name +
                             "' can never take effect: a non-finite step is never "
                             "applied, so there is nothing to clip");
  }
}

void check_policy(const YAML::Node& root, const PolicyConfig& config, const PolicyMarks& marks,
                  Checker* check) {
  check_detector_uses(config, marks, check);
  check_spike_rules(config, marks, check);
  check_needed_settings(root, config, marks, check);
}

}  // namespace detail
}  // namespace policy
}  // namespace stepguard
