// Reading a policy document into a PolicyConfig: the schema's names and where each section's
// keys and values go. The text and file entry points (UTF-8, one YAML document, syntax) are in
// policy_file.cpp; whether a value or key is acceptable is decided in policy_validation.cpp
// (Checker and the semantic checks); text is worded in policy_messages.cpp.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "csrc/policy/policy_file.h"
#include "csrc/policy/policy_file_internal.h"

namespace stepguard {
namespace policy {

using detail::Checker;
using detail::describe;
using detail::did_you_mean;
using detail::join;
using detail::kCheckpointKeys;
using detail::kLimitKeys;
using detail::kLossScaleKeys;
using detail::kRatioKeys;
using detail::kRecoveryKeys;
using detail::kReplicaKeys;
using detail::kRuleKeys;
using detail::kSpikeKeys;
using detail::kTopKeys;
using detail::kWithinKeys;

namespace {

// The actions a rule or limit may take and the parameters each takes (names: vocabulary.h).
struct ActionInfo {
  Action action;
  std::vector<std::string> params;
  const char* name() const noexcept { return to_string(action); }
};
const std::vector<ActionInfo> kActions = {
    {Action::kSkipBatch, {}},
    {Action::kDropLossScale, {"factor"}},
    {Action::kLowerLr, {"factor", "floor", "recover_after", "recover_over"}},
    {Action::kClip, {"z"}},
    {Action::kRollback, {"skip_batches"}},
    {Action::kAbort, {}},
    {Action::kAlert, {}},
    {Action::kResetMoments, {}},
};
const std::vector<std::string> kAllActionParams = {"factor",       "floor", "recover_after",
                                                   "recover_over", "z",     "skip_batches"};

// Names a rule's `on` accepts, and the signals each stands for: the signals a rule can listen
// to (names: vocabulary.h) and two aliases.
std::vector<std::pair<std::string, SignalSet>> on_names() {
  std::vector<std::pair<std::string, SignalSet>> out = {{"nonfinite", kNonfiniteSignals}};
  for (Signal s : {Signal::kNonfiniteGrad, Signal::kNonfiniteLoss, Signal::kLossSpike,
                   Signal::kGradNormSpike, Signal::kLossRatio, Signal::kReplicaDivergence,
                   Signal::kOverflow, Signal::kLossNotRecovered}) {
    out.push_back({to_string(s), bit(s)});
  }
  for (const TrendKind& k : trend_kinds()) out.push_back({k.key, bit(k.signal)});
  out.push_back({"spike", kSpikeSignals});
  return out;
}
const std::vector<std::pair<std::string, SignalSet>> kOnNames = on_names();

constexpr long long kMaxCount = 1000000000;  // bound of every step count, window and budget

std::vector<std::string> names_of(const std::vector<ActionInfo>& actions) {
  std::vector<std::string> out;
  for (const auto& a : actions) out.push_back(a.name());
  return out;
}

// Reads one section of a policy file into a PolicyConfig, reporting every problem, and notes in
// `marks` where the whole-file checks will point.
class Reader {
 public:
  Reader(Checker* check, PolicyConfig* out, detail::PolicyMarks* marks)
      : check_(*check), out_(*out), marks_(*marks) {}

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
      if (check_.number(n, "min_scale", 0, 1e38, false, false, &l.min_scale)) {
        detail::check_min_scale(n, l, &check_);
      }
    }
  }

  void detectors(const YAML::Node& d) {
    if (!check_.map(d, "detectors")) return;
    check_.check_keys(d, detail::detector_keys(), " in 'detectors'");
    detail::read_trends(d, &out_.detectors, &check_, &marks_);
    spike(d["loss_spike"], "loss_spike", &out_.detectors.loss_spike);
    spike(d["grad_norm_spike"], "grad_norm_spike", &out_.detectors.grad_norm_spike);
    if (const YAML::Node r = d["replica_divergence"]; r && !r.IsNull()) {
      if (check_.map(r, "replica_divergence")) {
        check_.check_keys(r, kReplicaKeys, " in 'detectors.replica_divergence'");
        count(r, "every", 0, &out_.detectors.replica_every);
      }
    }
    if (const YAML::Node r = d["loss_recovery"]; r) {
      marks_.configured_detectors.push_back("loss_recovery");
      DetectorSettings::Recovery& s = out_.detectors.loss_recovery;
      s.enabled = true;
      if (!r.IsNull() && check_.map(r, "loss_recovery")) {
        check_.check_keys(r, kRecoveryKeys, " in 'detectors.loss_recovery'");
        if (const YAML::Node n = r["enabled"]; n) check_.boolean(n, "enabled", &s.enabled);
        count(r, "within", 1, &s.within);
        if (const YAML::Node n = r["factor"]; n) {
          check_.number(n, "factor", 1, 1e12, true, false, &s.factor);
        }
      }
    }
    if (const YAML::Node r = d["loss_ratio"]; r) {
      marks_.configured_detectors.push_back("loss_ratio");
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
      marks_.loss_scale_floor = f.Mark();
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
      const YAML::Node on = r["on"];
      if (!on) {
        check_.issue(r.Mark(), "rule '" + rule.name + "' needs 'on' (a signal such as nonfinite)");
      } else {
        rule.on = signals_of(on, &rule);
        marks_.rule_on.push_back({out_.rules.size(), on.Mark()});
      }
      count(r, "consecutive", 1, &rule.consecutive);
      count(r, "after_step", 0, &rule.after_step);
      count(r, "cooldown", 0, &rule.cooldown);
      if (const YAML::Node w = r["within"]; w && check_.map(w, "within")) within(w, &rule);
      std::vector<std::string> keys = kRuleKeys;
      const YAML::Mark action_mark = r["action"] ? r["action"].Mark() : r.Mark();
      if (action_of(r, "rule '" + rule.name + "'",
                    {Action::kSkipBatch, Action::kDropLossScale, Action::kLowerLr, Action::kClip,
                     Action::kRollback, Action::kAbort, Action::kAlert, Action::kResetMoments},
                    keys, &rule.action)) {
        detail::check_clip(rule, action_mark, &check_);
      }
      if (rule.action.type == Action::kClip) needs_detector("grad_norm_spike", rule, action_mark);
      if (rule.action.type == Action::kRollback) marks_.rollback_actions.push_back(action_mark);
      out_.rules.push_back(rule);
    }
  }

  // A detector a rule uses but the file does not configure is on with its defaults.
  void enable_used_detectors() {
    const std::vector<std::string>& configured = marks_.configured_detectors;
    for (const auto& use : marks_.detector_uses) {
      const std::string& name = use.detector;
      if (std::find(configured.begin(), configured.end(), name) != configured.end()) continue;
      if (name == "loss_spike") out_.detectors.loss_spike.enabled = true;
      if (name == "grad_norm_spike") out_.detectors.grad_norm_spike.enabled = true;
      if (name == "loss_ratio") out_.detectors.loss_ratio.enabled = true;
      if (name == "loss_recovery") out_.detectors.loss_recovery.enabled = true;
      detail::enable_trend(name, &out_.detectors);
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
    marks_.configured_detectors.push_back(name);
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
    factor_or_off(node, "early_factor", &s->ema.early_factor);
    count(node, "early_after", 1, &s->ema.early_after);
    factor_or_off(node, "recent_factor", &s->ema.recent_factor);
    if (const YAML::Node n = node["recent_window"]; n) {
      long long v = 0;
      if (check_.whole_number(n, "recent_window", 2, 1024, &v)) s->ema.recent_window = v;
    }
    if (const YAML::Node n = node["detrend"]; n) check_.boolean(n, "detrend", &s->ema.detrend);
  }

  // A ratio at map[key]: 0 (off) or a number above 1.
  void factor_or_off(const YAML::Node& map, const std::string& key, double* out) {
    const YAML::Node n = map[key];
    double f = 0;
    if (!n || !check_.number(n, key, 0, 1e6, false, false, &f)) return;
    if (f > 0 && f <= 1) {
      check_.issue(n.Mark(),
                   "'" + key + "' must be 0 (off) or greater than 1, got '" + n.Scalar() + "'");
    } else {
      *out = f;
    }
  }

  void budget(const YAML::Node& node, const std::string& name, Budget* b,
              const std::vector<Action>& allowed) {
    if (!node || !check_.map(node, name)) return;
    if (name == "max_rollbacks") marks_.max_rollbacks = node.Mark();
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

  // A rule's `within` map: a window of steps and how many raises it must hold.
  void within(const YAML::Node& w, Rule* rule) {
    check_.check_keys(w, kWithinKeys, " in 'within'");
    const YAML::Node steps = w["steps"], n = w["count"];
    if (!steps || !n) {
      check_.issue(w.Mark(), "'within' needs both 'steps' and 'count'");
    } else if (count(w, "steps", 1, &rule->within_steps) &&
               count(w, "count", 1, &rule->within_count)) {
      detail::check_within(*rule, steps, n, &check_);
    }
  }

  // The `action` of a rule or limit and its parameters. `keys` are the other keys valid in `node`.
  bool action_of(const YAML::Node& node, const std::string& owner,
                 const std::vector<Action>& allowed, std::vector<std::string> keys,
                 ActionSpec* spec) {
    const ActionInfo* info = action_named(node, owner, allowed);
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
        std::string("is not a parameter of action '") + info->name() + "'" +
            (info->params.empty() ? " (it takes none)" : " (it takes " + join(info->params) + ")"));
    action_params(node, info->action, spec);
    return true;
  }

  // The action `node` names when it is known and in `allowed`; nullptr (reported) otherwise.
  const ActionInfo* action_named(const YAML::Node& node, const std::string& owner,
                                 const std::vector<Action>& allowed) {
    const YAML::Node a = node["action"];
    std::vector<std::string> allowed_names;
    for (const auto& i : kActions) {
      if (std::find(allowed.begin(), allowed.end(), i.action) != allowed.end()) {
        allowed_names.push_back(i.name());
      }
    }
    if (!a) {
      check_.issue(node.Mark(), owner + " needs 'action' (one of " + join(allowed_names) + ")");
      return nullptr;
    }
    if (!a.IsScalar()) {
      check_.issue(a.Mark(), "'action' must be an action name, got " + describe(a));
      return nullptr;
    }
    const ActionInfo* info = nullptr;
    for (const auto& i : kActions) {
      if (a.Scalar() == i.name()) info = &i;
    }
    if (info == nullptr) {
      check_.issue(a.Mark(), "unknown action '" + a.Scalar() + "'" +
                                 did_you_mean(a.Scalar(), names_of(kActions)) + "; one of " +
                                 join(allowed_names));
    } else if (std::find(allowed.begin(), allowed.end(), info->action) == allowed.end()) {
      check_.issue(a.Mark(), "action '" + a.Scalar() + "' is not allowed in " + owner +
                                 " (one of " + join(allowed_names) + ")");
      info = nullptr;
    }
    return info;
  }

  // The parameters `action` takes, from `node` into `spec`.
  void action_params(const YAML::Node& node, Action action, ActionSpec* spec) {
    switch (action) {
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
        if (const YAML::Node n = node["recover_after"];
            n && spec->recover_after > 0 && spec->recover_over == 0) {
          // recover_over 0 keeps the LR lowered for good: the wait would wait for nothing.
          check_.issue(n.Mark(),
                       "'recover_after' without 'recover_over' recovers nothing (the LR stays "
                       "lowered); add 'recover_over: N' to recover over N good steps after it");
        }
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
        if (word == "loss_spike" || word == "grad_norm_spike" || word == "loss_ratio" ||
            word == "loss_not_recovered" || detail::is_trend_key(word)) {
          needs_detector(word == "loss_not_recovered" ? "loss_recovery" : word, *rule, n.Mark());
        }
      }
      if (found) continue;
      if (word == "rank_desync" || word == "consecutive_limit") {
        check_.issue(n.Mark(), "'" + word +
                                   "' is handled by stepguard itself (it aborts) and cannot be "
                                   "used in 'on'");
      } else {
        check_.issue(n.Mark(), "unknown signal '" + word + "'" + did_you_mean(word, known) +
                                   "; one of " + join(known));
      }
    }
    return set;
  }

  void needs_detector(const std::string& name, const Rule& rule, const YAML::Mark& mark) {
    marks_.detector_uses.push_back({name, mark, "rule '" + rule.name + "'"});
  }

  Checker& check_;
  PolicyConfig& out_;
  detail::PolicyMarks& marks_;
};

}  // namespace

namespace detail {

void read_policy(const YAML::Node& root, PolicyConfig* config, PolicyMarks* marks, Checker* check) {
  check->check_keys(root, kTopKeys, "");
  Reader read(check, config, marks);
  read.version(root);
  if (const YAML::Node n = root["loss_scale"]; n) read.loss_scale(n);
  if (const YAML::Node n = root["detectors"]; n) read.detectors(n);
  if (const YAML::Node n = root["checkpoint"]; n) read.checkpoint(n);
  if (const YAML::Node n = root["limits"]; n) read.limits(n);
  if (const YAML::Node n = root["rules"]; n) read.rules(n);
  read.enable_used_detectors();
}

}  // namespace detail
}  // namespace policy
}  // namespace stepguard
