/*
 * Private to the policy-file code: what policy_file.cpp (the text and file entry points),
 * policy_reader.cpp (YAML into a PolicyConfig), policy_validation.cpp (keys, values,
 * contradictions, "can never fire") and policy_messages.cpp (human text) share. Not installed and
 * not an API; everything else includes policy_file.h.
 */
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "csrc/policy/policy.h"
#include "csrc/policy/policy_file.h"

namespace stepguard {
namespace policy {
namespace detail {

// Keys of schema version 1, by section.
inline const std::vector<std::string> kTopKeys = {"version", "detectors",  "rules",
                                                  "limits",  "loss_scale", "checkpoint"};
inline const std::vector<std::string> kLossScaleKeys = {
    "enabled",         "init_scale", "growth_factor", "backoff_factor",
    "growth_interval", "hysteresis", "min_scale"};
inline const std::vector<std::string> kLimitKeys = {"max_consecutive_bad_steps", "max_skips",
                                                    "max_rollbacks", "loss_scale_floor"};
inline const std::vector<std::string> kDetectorKeys = {
    "loss_spike", "grad_norm_spike", "loss_ratio", "replica_divergence", "loss_recovery"};
inline const std::vector<std::string> kRecoveryKeys = {"enabled", "within", "factor"};
inline const std::vector<std::string> kReplicaKeys = {"every"};
inline const std::vector<std::string> kSpikeKeys = {
    "enabled",       "z",      "warmup", "decay", "early_factor", "early_after", "recent_factor",
    "recent_window", "detrend"};
inline const std::vector<std::string> kRatioKeys = {"enabled", "factor", "reference_steps"};
inline const std::vector<std::string> kRuleKeys = {
    "name", "on", "consecutive", "within", "after_step", "cooldown", "action"};
inline const std::vector<std::string> kWithinKeys = {"steps", "count"};
inline const std::vector<std::string> kCheckpointKeys = {"snapshot_every", "snapshot_keep",
                                                         "disk_every", "disk_keep"};

/// Collects the issues of one policy file and reads typed scalars, reporting each value that is
/// wrong with its key and position. Defined in policy_validation.cpp. Not thread-safe.
class Checker {
 public:
  explicit Checker(std::string name) : name_(std::move(name)) {}

  /// Records `message` at `mark` (line and column 0 when the mark is null).
  void issue(const YAML::Mark& mark, const std::string& message);

  /// Reports keys of `map` not in `known`, suggesting the closest known key. Keys in `elsewhere`
  /// are known to the schema but not valid here; `why` says so.
  void check_keys(const YAML::Node& map, const std::vector<std::string>& known,
                  const std::string& where, const std::vector<std::string>& elsewhere = {},
                  const std::string& why = "");

  /// Whether `node` is a map; reports it when not.
  bool map(const YAML::Node& node, const std::string& key);

  /// A whole number in [lo, hi] into `out`; reports anything else.
  bool whole_number(const YAML::Node& node, const std::string& key, long long lo, long long hi,
                    long long* out);

  /// A finite number between lo and hi (each bound open or closed) into `out`.
  bool number(const YAML::Node& node, const std::string& key, double lo, double hi, bool open_lo,
              bool open_hi, double* out);

  /// `true` or `false` into `out`.
  bool boolean(const YAML::Node& node, const std::string& key, bool* out);

  /// The issues so far, in the order they were found.
  std::vector<PolicyIssue> take() { return std::move(issues_); }

 private:
  std::string name_;
  std::vector<PolicyIssue> issues_;
};

/// Where the reader found what the whole-file checks name in their issues.
struct PolicyMarks {
  /// A detector a rule relies on, by listening to its signal or by clipping with it.
  struct DetectorUse {
    std::string detector;  ///< "loss_spike", "grad_norm_spike" or "loss_ratio"
    YAML::Mark mark;
    std::string user;  ///< "rule '<name>'"
  };

  std::vector<std::string> configured_detectors;  ///< named under 'detectors', in file order
  std::vector<DetectorUse> detector_uses;
  std::vector<std::pair<std::size_t, YAML::Mark>> rule_on;  ///< rule index, position of its 'on'
  std::vector<YAML::Mark> rollback_actions;                 ///< rules whose action is rollback
  YAML::Mark max_rollbacks;                                 ///< the 'limits.max_rollbacks' map
  YAML::Mark loss_scale_floor;                              ///< the 'limits.loss_scale_floor' map
};

// The trend detectors' sections (trend_reader.cpp).
/// The keys `detectors` accepts: kDetectorKeys and every trend detector's.
std::vector<std::string> detector_keys();
/// Reads every trend detector's section of `detectors` into `out->trends`.
void read_trends(const YAML::Node& detectors, DetectorSettings* out, Checker* check,
                 PolicyMarks* marks);
/// Turns on the trend detector `name` (a rule uses it); nothing when `name` is none.
void enable_trend(const std::string& name, DetectorSettings* out);
/// Whether `word` names a trend detector (and its signal).
bool is_trend_key(const std::string& word);

/// Reads the sections of `root` (a map; policy_reader.cpp) into `config`, reporting every problem
/// through `check` and noting in `marks` where the whole-file checks will point.
void read_policy(const YAML::Node& root, PolicyConfig* config, PolicyMarks* marks, Checker* check);

// Checks of policy_validation.cpp. Each reports through `check` what contradicts itself or can
// never take effect. The reader calls each as soon as the values it needs are read and valid, so
// two issues at one position are reported in a fixed order.

/// 'min_scale' (at `node`, already read into `scale`) above 'init_scale'.
void check_min_scale(const YAML::Node& node, const LossScaleSettings& scale, Checker* check);

/// A rule's 'within' asking for more raises than its window has steps.
void check_within(const Rule& rule, const YAML::Node& steps, const YAML::Node& count,
                  Checker* check);

/// A clip rule that listens only to non-finite steps, which are never applied.
void check_clip(const Rule& rule, const YAML::Mark& action, Checker* check);

/// Checks that need the whole file: disabled detectors the rules use, spike rules with no spike
/// detector, rollback without snapshots, limits that cannot fire.
void check_policy(const YAML::Node& root, const PolicyConfig& config, const PolicyMarks& marks,
                  Checker* check);

// Message pieces of policy_messages.cpp.

/// " (did you mean 'x'?)" for the known word closest to `word`, or "" when none is close.
std::string did_you_mean(const std::string& word, const std::vector<std::string>& known);

/// How a value looks, for messages: 'text', or what kind of node it is.
std::string describe(const YAML::Node& node);

/// "a, b, c".
std::string join(const std::vector<std::string>& words);

}  // namespace detail
}  // namespace policy
}  // namespace stepguard
