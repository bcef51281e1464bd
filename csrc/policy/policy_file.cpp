#include "csrc/policy/policy_file.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>

namespace stepguard {
namespace policy {

namespace {

// Keys of schema version 1, by section.
const std::vector<std::string> kTopKeys = {"version", "detectors",  "rules",
                                           "limits",  "loss_scale", "checkpoint"};
const std::vector<std::string> kLossScaleKeys = {
    "enabled",         "init_scale", "growth_factor", "backoff_factor",
    "growth_interval", "hysteresis", "min_scale"};
const std::vector<std::string> kLimitKeys = {"max_consecutive_bad_steps", "max_skips",
                                             "max_rollbacks", "loss_scale_floor"};
const std::vector<std::string> kDetectorKeys = {"loss_spike", "grad_norm_spike", "loss_ratio"};
const std::vector<std::string> kSpikeKeys = {"enabled", "z", "warmup", "decay"};
const std::vector<std::string> kRatioKeys = {"enabled", "factor", "reference_steps"};
const std::vector<std::string> kRuleKeys = {"name",       "on",       "consecutive", "within",
                                            "after_step", "cooldown", "action"};
const std::vector<std::string> kWithinKeys = {"steps", "count"};
const std::vector<std::string> kCheckpointKeys = {"snapshot_every", "snapshot_keep", "disk_every",
                                                  "disk_keep"};

// Action names and the parameters each takes.
struct ActionInfo {
  const char* name;
  Action action;
  std::vector<std::string> params;
};
const std::vector<ActionInfo> kActions = {
    {"skip_batch", Action::kSkipBatch, {}},
    {"drop_loss_scale", Action::kDropLossScale, {"factor"}},
    {"lower_lr", Action::kLowerLr, {"factor", "floor", "recover_after", "recover_over"}},
    {"clip", Action::kClip, {"z"}},
    {"rollback", Action::kRollback, {"skip_batches"}},
    {"abort", Action::kAbort, {}},
    {"alert", Action::kAlert, {}},
};
const std::vector<std::string> kAllActionParams = {"factor",       "floor", "recover_after",
                                                   "recover_over", "z",     "skip_batches"};

// Names a rule's `on` accepts, and the signals each stands for.
const std::vector<std::pair<std::string, SignalSet>> kOnNames = {
    {"nonfinite", kNonfiniteSignals},
    {"nonfinite_grad", bit(Signal::kNonfiniteGrad)},
    {"nonfinite_loss", bit(Signal::kNonfiniteLoss)},
    {"loss_spike", bit(Signal::kLossSpike)},
    {"grad_norm_spike", bit(Signal::kGradNormSpike)},
    {"loss_ratio", bit(Signal::kLossRatio)},
    {"spike", kSpikeSignals},
};

std::vector<std::string> names_of(const std::vector<ActionInfo>& actions) {
  std::vector<std::string> out;
  for (const auto& a : actions) out.push_back(a.name);
  return out;
}

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

// How a value looks, for messages: 'text', or what kind of node it is.
std::string describe(const YAML::Node& node) {
  if (node.IsScalar()) return "'" + node.Scalar() + "'";
  if (node.IsMap()) return "a map";
  if (node.IsSequence()) return "a list";
  return "nothing";
}

class Checker {
 public:
  explicit Checker(std::string name) : name_(std::move(name)) {}

  void issue(const YAML::Mark& mark, const std::string& message) {
    issues_.push_back(
        {name_, mark.is_null() ? 0 : mark.line + 1, mark.is_null() ? 0 : mark.column + 1, message});
  }

  // " (did you mean 'x'?)" for the known word closest to `word`, or "" when none is close.
  static std::string suggestion(const std::string& word, const std::vector<std::string>& known) {
    // A word that starts a known one ('skip' -> 'skip_batch') beats a near spelling.
    if (word.size() >= 3) {
      for (const auto& k : known) {
        if (k.size() > word.size() && k.compare(0, word.size(), word) == 0) {
          return " (did you mean '" + k + "'?)";
        }
      }
    }
    std::string best;
    std::size_t best_distance = std::max<std::size_t>(2, word.size() / 3) + 1;
    for (const auto& k : known) {
      const std::size_t d = edit_distance(word, k);
      if (d < best_distance) {
        best = k;
        best_distance = d;
      }
    }
    return best.empty() ? "" : " (did you mean '" + best + "'?)";
  }

  // Reports keys of `map` not in `known`, suggesting the closest known key. Keys in `elsewhere`
  // are known to the schema but not valid here; `why` says so.
  void check_keys(const YAML::Node& map, const std::vector<std::string>& known,
                  const std::string& where, const std::vector<std::string>& elsewhere = {},
                  const std::string& why = "") {
    for (const auto& item : map) {
      const std::string key = item.first.IsScalar() ? item.first.Scalar() : std::string();
      if (std::find(known.begin(), known.end(), key) != known.end()) continue;
      if (!why.empty() && std::find(elsewhere.begin(), elsewhere.end(), key) != elsewhere.end()) {
        issue(item.first.Mark(), "'" + key + "' " + why);
        continue;
      }
      if (!item.first.IsScalar()) {
        issue(item.first.Mark(), "a key must be a plain word" + where);
        continue;
      }
      issue(item.first.Mark(), "unknown key '" + key + "'" + where + suggestion(key, known));
    }
  }

  // Whether `node` is a map; reports it when not.
  bool map(const YAML::Node& node, const std::string& key) {
    if (node.IsMap()) return true;
    issue(node.Mark(), "'" + key + "' must be a map");
    return false;
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
        << describe(node);
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
        << (open_hi ? ")" : "]") << ", got " << describe(node);
    issue(node.Mark(), msg.str());
    return false;
  }

  bool boolean(const YAML::Node& node, const std::string& key, bool* out) {
    if (node.IsScalar() && (node.Scalar() == "true" || node.Scalar() == "false")) {
      *out = node.Scalar() == "true";
      return true;
    }
    issue(node.Mark(), "'" + key + "' must be true or false, got " + describe(node));
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

namespace {

constexpr long long kMaxCount = 1000000000;  // bound of every step count, window and budget

// Reads one section of a policy file into a PolicyConfig, reporting every problem.
class Reader {
 public:
  Reader(Checker* check, PolicyConfig* out) : check_(*check), out_(*out) {}

  void version(const YAML::Node& root) {
    const YAML::Node version = root["version"];
    if (!version) {
      check_.issue(root.Mark(), "missing required key 'version' (this stepguard reads version " +
                                    std::to_string(kPolicySchemaVersion) + ")");
      return;
    }
    long long v = 0;
    if (check_.whole_number(version, "version", 1, 1000000, &v) && v != kPolicySchemaVersion) {
      check_.issue(version.Mark(), "unsupported schema version " + std::to_string(v) +
                                       " (this stepguard reads version " +
                                       std::to_string(kPolicySchemaVersion) + ")");
    }
  }

  void loss_scale(const YAML::Node& ls) {
    if (!check_.map(ls, "loss_scale")) return;
    check_.check_keys(ls, kLossScaleKeys, " in 'loss_scale'");
    out_.has_loss_scale = true;
    LossScaleSettings& l = out_.loss_scale;
    l.enabled = true;  // a loss_scale section turns scaling on unless it says enabled: false
    if (const YAML::Node n = ls["enabled"]; n) check_.boolean(n, "enabled", &l.enabled);
    if (const YAML::Node n = ls["init_scale"]; n) {
      check_.number(n, "init_scale", 0, 1e38, true, false, &l.init_scale);
    }
    if (const YAML::Node n = ls["growth_factor"]; n) {
      check_.number(n, "growth_factor", 1, 1e6, true, false, &l.growth_factor);
    }
    if (const YAML::Node n = ls["backoff_factor"]; n) {
      check_.number(n, "backoff_factor", 0, 1, true, true, &l.backoff_factor);
    }
    count(ls, "growth_interval", 1, &l.growth_interval);
    if (const YAML::Node n = ls["hysteresis"]; n) {
      long long v = 0;
      if (check_.whole_number(n, "hysteresis", 1, 1000000, &v)) l.hysteresis = v;
    }
    if (const YAML::Node n = ls["min_scale"]; n) {
      if (check_.number(n, "min_scale", 0, 1e38, false, false, &l.min_scale) &&
          l.min_scale > l.init_scale) {
        check_.issue(n.Mark(), "'min_scale' " + n.Scalar() + " is above 'init_scale'");
      }
    }
  }

  void detectors(const YAML::Node& d) {
    if (!check_.map(d, "detectors")) return;
    check_.check_keys(d, kDetectorKeys, " in 'detectors'");
    spike(d["loss_spike"], "loss_spike", &out_.detectors.loss_spike);
    spike(d["grad_norm_spike"], "grad_norm_spike", &out_.detectors.grad_norm_spike);
    if (const YAML::Node r = d["loss_ratio"]; r) {
      explicit_detectors_.push_back("loss_ratio");
      RatioSettings& s = out_.detectors.loss_ratio;
      s.enabled = true;
      if (r.IsNull()) return;  // `loss_ratio:` alone turns it on with the defaults
      if (!check_.map(r, "loss_ratio")) return;
      check_.check_keys(r, kRatioKeys, " in 'detectors.loss_ratio'");
      if (const YAML::Node n = r["enabled"]; n) check_.boolean(n, "enabled", &s.enabled);
      if (const YAML::Node n = r["factor"]; n) {
        check_.number(n, "factor", 1, 1e12, true, false, &s.ratio.factor);
      }
      count(r, "reference_steps", 1, &s.ratio.reference_steps);
    }
  }

  void checkpoint(const YAML::Node& c) {
    if (!check_.map(c, "checkpoint")) return;
    check_.check_keys(c, kCheckpointKeys, " in 'checkpoint'");
    CheckpointCadence& k = out_.checkpoint;
    count(c, "snapshot_every", 0, &k.snapshot_every);
    count(c, "snapshot_keep", 1, &k.snapshot_keep);
    count(c, "disk_every", 0, &k.disk_every);
    count(c, "disk_keep", 1, &k.disk_keep);
  }

  void limits(const YAML::Node& l) {
    if (!check_.map(l, "limits")) return;
    check_.check_keys(l, kLimitKeys, " in 'limits'");
    Limits& lim = out_.limits;
    count(l, "max_consecutive_bad_steps", 0, &lim.max_consecutive_bad_steps);
    budget(l["max_skips"], "max_skips", &lim.max_skips,
           {Action::kAbort, Action::kRollback, Action::kAlert, Action::kLowerLr});
    budget(l["max_rollbacks"], "max_rollbacks", &lim.max_rollbacks,
           {Action::kAbort, Action::kAlert, Action::kLowerLr});
    if (const YAML::Node f = l["loss_scale_floor"]; f && check_.map(f, "loss_scale_floor")) {
      std::vector<std::string> keys = {"steps", "action"};
      action_of(f, "limits.loss_scale_floor",
                {Action::kAbort, Action::kRollback, Action::kAlert, Action::kLowerLr}, keys,
                &lim.loss_scale_floor_action);
      if (const YAML::Node n = f["steps"]; !n) {
        check_.issue(f.Mark(), "'limits.loss_scale_floor' needs 'steps'");
      } else {
        count(f, "steps", 1, &lim.loss_scale_floor_steps);
      }
      floor_limit_mark_ = f.Mark();
    }
  }

  void rules(const YAML::Node& rules) {
    out_.has_rules = true;
    if (!rules.IsSequence()) {
      check_.issue(rules.Mark(), "'rules' must be a list of rules (each item starts with '- on:')");
      return;
    }
    int index = 0;
    for (const YAML::Node& r : rules) {
      ++index;
      Rule rule;
      rule.name = "rule " + std::to_string(index);
      if (!r.IsMap()) {
        check_.issue(r.Mark(), "rule " + std::to_string(index) +
                                   " must be a map with 'on' and "
                                   "'action'");
        continue;
      }
      if (const YAML::Node n = r["name"]; n) {
        if (n.IsScalar() && !n.Scalar().empty()) {
          rule.name = n.Scalar();
        } else {
          check_.issue(n.Mark(), "'name' must be a non-empty text, got " + describe(n));
        }
      }
      const std::string where = " in rule '" + rule.name + "'";
      const YAML::Node on = r["on"];
      if (!on) {
        check_.issue(r.Mark(), "rule '" + rule.name + "' needs 'on' (a signal such as nonfinite)");
      } else {
        rule.on = signals_of(on, &rule);
        on_marks_.push_back({out_.rules.size(), on.Mark()});
      }
      count(r, "consecutive", 1, &rule.consecutive);
      count(r, "after_step", 0, &rule.after_step);
      count(r, "cooldown", 0, &rule.cooldown);
      if (const YAML::Node w = r["within"]; w && check_.map(w, "within")) {
        check_.check_keys(w, kWithinKeys, " in 'within'");
        const YAML::Node steps = w["steps"], n = w["count"];
        if (!steps || !n) {
          check_.issue(w.Mark(), "'within' needs both 'steps' and 'count'");
        } else if (count(w, "steps", 1, &rule.within_steps) &&
                   count(w, "count", 1, &rule.within_count) &&
                   rule.within_count > rule.within_steps) {
          check_.issue(n.Mark(), "rule '" + rule.name + "' can never fire: 'count' " + n.Scalar() +
                                     " is more than the window of " + steps.Scalar() + " steps");
        }
      }
      std::vector<std::string> keys = kRuleKeys;
      const YAML::Mark action_mark = r["action"] ? r["action"].Mark() : r.Mark();
      if (action_of(r, "rule '" + rule.name + "'",
                    {Action::kSkipBatch, Action::kDropLossScale, Action::kLowerLr, Action::kClip,
                     Action::kRollback, Action::kAbort, Action::kAlert},
                    keys, &rule.action) &&
          rule.action.type == Action::kClip && rule.on != 0 &&
          (rule.on & ~kNonfiniteSignals) == 0) {
        check_.issue(action_mark, "rule '" + rule.name +
                                      "' can never take effect: a non-finite step is never "
                                      "applied, so there is nothing to clip");
      }
      if (rule.action.type == Action::kClip) needs_detector("grad_norm_spike", rule, action_mark);
      if (rule.action.type == Action::kRollback) rollback_marks_.push_back(action_mark);
      out_.rules.push_back(rule);
    }
  }

  // Checks that need the whole file: detectors the rules use, and actions that need a setting.
  void finish(const YAML::Node& root) {
    for (const auto& [name, mark] : detector_uses_) {
      if (std::find(explicit_detectors_.begin(), explicit_detectors_.end(), name) ==
          explicit_detectors_.end()) {
        // Used but not configured: on with its defaults.
        if (name == "loss_spike") out_.detectors.loss_spike.enabled = true;
        if (name == "grad_norm_spike") out_.detectors.grad_norm_spike.enabled = true;
        if (name == "loss_ratio") out_.detectors.loss_ratio.enabled = true;
      } else if ((name == "loss_spike" && !out_.detectors.loss_spike.enabled) ||
                 (name == "grad_norm_spike" && !out_.detectors.grad_norm_spike.enabled) ||
                 (name == "loss_ratio" && !out_.detectors.loss_ratio.enabled)) {
        check_.issue(mark.first,
                     mark.second + " can never fire: 'detectors." + name + "' is disabled");
      }
    }
    // `spike` listens to the detectors that are on; it turns none on by itself.
    SignalSet detecting = 0;
    if (out_.detectors.loss_spike.enabled) detecting |= bit(Signal::kLossSpike);
    if (out_.detectors.grad_norm_spike.enabled) detecting |= bit(Signal::kGradNormSpike);
    if (out_.detectors.loss_ratio.enabled) detecting |= bit(Signal::kLossRatio);
    for (const auto& [index, mark] : on_marks_) {
      const Rule& rule = out_.rules[index];
      if (rule.on == kSpikeSignals && (rule.on & detecting) == 0) {
        check_.issue(mark, "rule '" + rule.name +
                               "' can never fire: no spike detector is on (configure one under "
                               "'detectors')");
      }
    }
    const bool rollback = out_.uses(Action::kRollback);
    if (rollback && out_.checkpoint.snapshot_every == 0) {
      const YAML::Mark m = !rollback_marks_.empty() ? rollback_marks_.front() : root.Mark();
      check_.issue(m, "'rollback' needs RAM snapshots: set 'checkpoint.snapshot_every'");
    }
    if (out_.limits.max_rollbacks.enabled && !rollback) {
      check_.issue(max_rollbacks_mark_,
                   "'limits.max_rollbacks' can never fire: no rule or limit rolls back");
    }
    if (out_.limits.loss_scale_floor_steps > 0 &&
        !(out_.has_loss_scale && out_.loss_scale.enabled && out_.loss_scale.min_scale > 0)) {
      check_.issue(floor_limit_mark_,
                   "'limits.loss_scale_floor' can never fire: set 'loss_scale.min_scale' above 0");
    }
  }

 private:
  // A whole number >= lo at map[key], if present. Returns true when present and valid.
  bool count(const YAML::Node& map, const std::string& key, long long lo, std::int64_t* out) {
    const YAML::Node n = map[key];
    if (!n) return false;
    long long v = 0;
    if (!check_.whole_number(n, key, lo, kMaxCount, &v)) return false;
    *out = v;
    return true;
  }

  void spike(const YAML::Node& node, const std::string& name, SpikeSettings* s) {
    if (!node) return;
    explicit_detectors_.push_back(name);
    s->enabled = true;
    if (node.IsNull()) return;  // `loss_spike:` alone turns it on with the defaults
    if (!check_.map(node, name)) return;
    check_.check_keys(node, kSpikeKeys, " in 'detectors." + name + "'");
    if (const YAML::Node n = node["enabled"]; n) check_.boolean(n, "enabled", &s->enabled);
    if (const YAML::Node n = node["z"]; n) {
      check_.number(n, "z", 0, 1e6, true, false, &s->ema.threshold);
    }
    count(node, "warmup", 0, &s->ema.warmup);
    if (const YAML::Node n = node["decay"]; n) {
      check_.number(n, "decay", 0, 1, true, true, &s->ema.decay);
    }
  }

  void budget(const YAML::Node& node, const std::string& name, Budget* b,
              const std::vector<Action>& allowed) {
    if (!node || !check_.map(node, name)) return;
    if (name == "max_rollbacks") max_rollbacks_mark_ = node.Mark();
    std::vector<std::string> keys = {"count", "within", "action"};
    action_of(node, "limits." + name, allowed, keys, &b->action);
    const YAML::Node c = node["count"], w = node["within"];
    if (!c || !w) {
      check_.issue(node.Mark(), "'limits." + name + "' needs both 'count' and 'within' (steps)");
      return;
    }
    if (count(node, "count", 0, &b->count) && count(node, "within", 1, &b->window)) {
      b->enabled = true;
    }
  }

  // The `action` of a rule or limit and its parameters. `keys` are the other keys valid in `node`.
  bool action_of(const YAML::Node& node, const std::string& owner,
                 const std::vector<Action>& allowed, std::vector<std::string> keys,
                 ActionSpec* spec) {
    const YAML::Node a = node["action"];
    const ActionInfo* info = nullptr;
    std::vector<std::string> allowed_names;
    for (const auto& i : kActions) {
      if (std::find(allowed.begin(), allowed.end(), i.action) != allowed.end()) {
        allowed_names.push_back(i.name);
      }
    }
    if (!a) {
      check_.issue(node.Mark(), owner + " needs 'action' (one of " + join(allowed_names) + ")");
    } else if (!a.IsScalar()) {
      check_.issue(a.Mark(), "'action' must be an action name, got " + describe(a));
    } else {
      for (const auto& i : kActions) {
        if (a.Scalar() == i.name) info = &i;
      }
      if (info == nullptr) {
        check_.issue(a.Mark(), "unknown action '" + a.Scalar() + "'" +
                                   Checker::suggestion(a.Scalar(), names_of(kActions)) +
                                   "; one of " + join(allowed_names));
      } else if (std::find(allowed.begin(), allowed.end(), info->action) == allowed.end()) {
        check_.issue(a.Mark(), "action '" + a.Scalar() + "' is not allowed in " + owner +
                                   " (one of " + join(allowed_names) + ")");
        info = nullptr;
      }
    }
    if (info == nullptr) {
      // Still report unknown keys, treating every action parameter as known.
      keys.insert(keys.end(), kAllActionParams.begin(), kAllActionParams.end());
      check_.check_keys(node, keys, " in " + owner);
      return false;
    }
    spec->type = info->action;
    keys.insert(keys.end(), info->params.begin(), info->params.end());
    check_.check_keys(
        node, keys, " in " + owner, kAllActionParams,
        std::string("is not a parameter of action '") + info->name + "'" +
            (info->params.empty() ? " (it takes none)" : " (it takes " + join(info->params) + ")"));
    switch (info->action) {
      case Action::kDropLossScale:
        if (const YAML::Node n = node["factor"]; n) {
          check_.number(n, "factor", 0, 1, true, true, &spec->factor);
        }
        break;
      case Action::kLowerLr:
        spec->floor = 0.01;
        if (const YAML::Node n = node["factor"]; n) {
          check_.number(n, "factor", 0, 1, true, true, &spec->factor);
        }
        if (const YAML::Node n = node["floor"]; n) {
          check_.number(n, "floor", 0, 1, true, false, &spec->floor);
        }
        count(node, "recover_after", 0, &spec->recover_after);
        count(node, "recover_over", 0, &spec->recover_over);
        break;
      case Action::kClip:
        if (const YAML::Node n = node["z"]; n) check_.number(n, "z", 0, 1e6, true, false, &spec->z);
        break;
      case Action::kRollback:
        count(node, "skip_batches", 0, &spec->skip_batches);
        break;
      default:
        break;
    }
    return true;
  }

  SignalSet signals_of(const YAML::Node& on, Rule* rule) {
    std::vector<YAML::Node> items;
    if (on.IsSequence()) {
      for (const YAML::Node& n : on) items.push_back(n);
      if (items.empty()) check_.issue(on.Mark(), "'on' must name at least one signal");
    } else {
      items.push_back(on);
    }
    std::vector<std::string> known;
    for (const auto& [name, set] : kOnNames) known.push_back(name);
    SignalSet set = 0;
    for (const YAML::Node& n : items) {
      if (!n.IsScalar()) {
        check_.issue(n.Mark(), "'on' must be a signal name or a list of them, got " + describe(n));
        continue;
      }
      const std::string& word = n.Scalar();
      bool found = false;
      for (const auto& [name, bits] : kOnNames) {
        if (word != name) continue;
        found = true;
        set |= bits;
        if (word == "loss_spike" || word == "grad_norm_spike" || word == "loss_ratio") {
          needs_detector(word, *rule, n.Mark());
        }
      }
      if (found) continue;
      if (word == "rank_desync" || word == "consecutive_limit") {
        check_.issue(n.Mark(), "'" + word +
                                   "' is handled by stepguard itself (it aborts) and cannot be "
                                   "used in 'on'");
      } else {
        check_.issue(n.Mark(), "unknown signal '" + word + "'" + Checker::suggestion(word, known) +
                                   "; one of " + join(known));
      }
    }
    return set;
  }

  void needs_detector(const std::string& name, const Rule& rule, const YAML::Mark& mark) {
    detector_uses_.push_back({name, {mark, "rule '" + rule.name + "'"}});
  }

  static std::string join(const std::vector<std::string>& words) {
    std::string out;
    for (const auto& w : words) out += (out.empty() ? "" : ", ") + w;
    return out;
  }

  Checker& check_;
  PolicyConfig& out_;
  std::vector<std::string> explicit_detectors_;
  std::vector<std::pair<std::string, std::pair<YAML::Mark, std::string>>> detector_uses_;
  std::vector<YAML::Mark> rollback_marks_;
  std::vector<std::pair<std::size_t, YAML::Mark>> on_marks_;  // rule index, position of its 'on'

  YAML::Mark max_rollbacks_mark_;
  YAML::Mark floor_limit_mark_;
};

}  // namespace

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
  Reader read(&check, &parsed);
  read.version(root);
  if (const YAML::Node n = root["loss_scale"]; n) read.loss_scale(n);
  if (const YAML::Node n = root["detectors"]; n) read.detectors(n);
  if (const YAML::Node n = root["checkpoint"]; n) read.checkpoint(n);
  if (const YAML::Node n = root["limits"]; n) read.limits(n);
  if (const YAML::Node n = root["rules"]; n) read.rules(n);
  read.finish(root);
  std::vector<PolicyIssue> issues = check.take();
  // Issues in file order, as a compiler reports them.
  std::stable_sort(issues.begin(), issues.end(), [](const PolicyIssue& a, const PolicyIssue& b) {
    return std::tie(a.line, a.column) < std::tie(b.line, b.column);
  });
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

namespace {

std::string signal_words(SignalSet on) {
  if (on == kNonfiniteSignals) return "a NaN/Inf gradient or loss";
  std::vector<std::string> parts;
  const std::pair<Signal, const char*> words[] = {
      {Signal::kNonfiniteGrad, "a NaN/Inf gradient"},
      {Signal::kNonfiniteLoss, "a NaN/Inf loss"},
      {Signal::kLossSpike, "a loss spike"},
      {Signal::kGradNormSpike, "a grad-norm spike"},
      {Signal::kLossRatio, "a loss above the ratio limit"},
  };
  for (const auto& [signal, word] : words) {
    if (on & bit(signal)) parts.push_back(word);
  }
  std::string out;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == parts.size() ? " or " : ", ") + parts[i];
  }
  return out;
}

std::string action_words(const ActionSpec& a, const DetectorSettings& d) {
  std::ostringstream out;
  switch (a.type) {
    case Action::kSkipBatch:
      out << "skip the batch";
      break;
    case Action::kDropLossScale:
      out << "multiply the loss scale by " << a.factor;
      break;
    case Action::kLowerLr:
      out << "multiply the LR by " << a.factor << " (not below " << a.floor << "x)";
      if (a.recover_over > 0) {
        out << ", recovering linearly over " << a.recover_over << " good steps";
        if (a.recover_after > 0) out << " after " << a.recover_after << " good steps";
      } else {
        out << ", staying lowered";
      }
      break;
    case Action::kClip:
      out << "clip the grad norm to its EMA mean + "
          << (a.z > 0 ? a.z : d.grad_norm_spike.ema.threshold) << " EMA standard deviations";
      break;
    case Action::kRollback:
      out << "roll back to the newest good snapshot";
      if (a.skip_batches > 0) out << " and skip the next " << a.skip_batches << " batches";
      break;
    case Action::kAbort:
      out << "abort training";
      break;
    case Action::kAlert:
      out << "record and alert only";
      break;
    case Action::kApply:
      out << "apply the step";
      break;
  }
  return out.str();
}

}  // namespace

std::string explain_policy(const PolicyConfig& config) {
  std::ostringstream out;
  out << "On every step, all gradients and the loss are checked for NaN/Inf in one pass, and all "
         "ranks agree on the result in one all-reduce.\n";
  const DetectorSettings& d = config.detectors;
  if (d.loss_spike.enabled || d.grad_norm_spike.enabled || d.loss_ratio.enabled) {
    out << "Detectors:\n";
    auto spike = [&out](const char* what, const SpikeSettings& s) {
      out << "  - " << what << " spike: more than " << s.ema.threshold
          << " standard deviations above its moving average (decay " << s.ema.decay << "), after "
          << s.ema.warmup << " steps of warm-up; spikes do not move the average\n";
    };
    if (d.loss_spike.enabled) spike("loss", d.loss_spike);
    if (d.grad_norm_spike.enabled) spike("grad-norm", d.grad_norm_spike);
    if (d.loss_ratio.enabled) {
      out << "  - loss ratio: a loss above " << d.loss_ratio.ratio.factor
          << "x the largest loss of the first " << d.loss_ratio.ratio.reference_steps << " steps\n";
    }
  }
  if (config.rules.empty()) {
    out << "Rules: none; the built-in ladder applies.\n";
  } else {
    out << "Rules, checked in this order on every step (several may fire):\n";
    int i = 0;
    for (const Rule& r : config.rules) {
      out << "  " << ++i << ". [" << r.name << "] on ";
      if (r.consecutive > 1) {
        out << r.consecutive << " steps in a row with " << signal_words(r.on) << " (and every "
            << r.consecutive << " more)";
      } else {
        out << signal_words(r.on);
      }
      if (r.within_count > 0) {
        out << ", when it happened " << r.within_count << " times within " << r.within_steps
            << " steps";
      }
      if (r.after_step > 0) out << ", after step " << r.after_step;
      out << ": " << action_words(r.action, d);
      if (r.cooldown > 0) out << "; then quiet for " << r.cooldown << " steps";
      out << ".\n";
    }
  }
  out << "Always: a clean step is applied; a NaN/Inf step is never applied (it is skipped when no "
         "rule does more); ranks whose guard state diverged abort training; a signal no rule acts "
         "on is recorded as an alert.\n";
  out << "Combining: abort wins over everything; rollback replaces skip; a step that is not "
         "applied is not clipped; loss-scale and LR changes apply on top (after a rollback's "
         "restore); of one action from several rules, the strongest parameters win.\n";
  const Limits& l = config.limits;
  out << "Limits:\n";
  if (l.max_consecutive_bad_steps > 0) {
    out << "  - " << l.max_consecutive_bad_steps << " bad steps in a row: abort training.\n";
  } else {
    out << "  - no limit on bad steps in a row.\n";
  }
  if (l.max_skips.enabled) {
    out << "  - more than " << l.max_skips.count << " skipped steps within " << l.max_skips.window
        << " steps: " << action_words(l.max_skips.action, d) << ".\n";
  }
  if (l.max_rollbacks.enabled) {
    out << "  - more than " << l.max_rollbacks.count << " rollbacks within "
        << l.max_rollbacks.window << " steps: " << action_words(l.max_rollbacks.action, d) << ".\n";
  }
  if (l.loss_scale_floor_steps > 0) {
    out << "  - the loss scale at its floor for " << l.loss_scale_floor_steps
        << " steps: " << action_words(l.loss_scale_floor_action, d) << ".\n";
  }
  if (config.has_loss_scale && config.loss_scale.enabled) {
    const LossScaleSettings& s = config.loss_scale;
    out << "Loss scaling (fp16): start at " << s.init_scale << "; on a NaN/Inf step multiply by "
        << s.backoff_factor;
    if (s.hysteresis > 1) out << " after " << s.hysteresis << " such steps";
    out << "; after " << s.growth_interval << " clean steps multiply by " << s.growth_factor;
    if (s.min_scale > 0) out << "; never below " << s.min_scale;
    out << ".\n";
  }
  const CheckpointCadence& c = config.checkpoint;
  if (c.snapshot_every > 0) {
    out << "Snapshots: in RAM every " << c.snapshot_every << " steps, keeping " << c.snapshot_keep
        << ".\n";
  }
  if (c.disk_every > 0) {
    out << "Checkpoints: on disk every " << c.disk_every << " steps, keeping " << c.disk_keep
        << ".\n";
  }
  return out.str();
}

}  // namespace policy
}  // namespace stepguard
