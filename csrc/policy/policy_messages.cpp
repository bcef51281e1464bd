// Human text about policies: "did you mean" for misspelt names, how a value looks in an issue,
// issues as "file:line:col: message", and explain_policy(), the policy's ladder in plain words.
// Which problems a file has is decided by the reader and the validation; this file only words
// them.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "csrc/policy/policy_file.h"
#include "csrc/policy/policy_file_internal.h"

namespace stepguard {
namespace policy {

namespace {

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

std::string signal_words(SignalSet on) {
  if (on == kNonfiniteSignals) return "a NaN/Inf gradient or loss";
  std::vector<std::string> parts;
  const std::pair<Signal, const char*> words[] = {
      {Signal::kNonfiniteGrad, "a NaN/Inf gradient"},
      {Signal::kNonfiniteLoss, "a NaN/Inf loss"},
      {Signal::kLossSpike, "a loss spike"},
      {Signal::kGradNormSpike, "a grad-norm spike"},
      {Signal::kLossRatio, "a loss above the ratio limit"},
      {Signal::kReplicaDivergence, "a rank whose parameters differ from the other replicas'"},
      {Signal::kOverflow, "an fp16 overflow the loss scale can still back off from"},
      {Signal::kLossNotRecovered, "a loss that has not come back after a spike"},
      {Signal::kLossTrend, "a loss rising smoothly (loss_trend)"},
      {Signal::kStall, "training that stopped moving (stall)"},
      {Signal::kRankLossShift, "one rank's loss standing apart for several steps"},
      {Signal::kOptimizerState, "an optimizer state holding NaN/Inf or a negative second moment"},
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
          << (a.z > 0 ? a.z : d.grad_norm_spike.ema.threshold)
          << " EMA standard deviations (on a grad-norm spike alone: counted, no incident)";
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
    case Action::kResetMoments:
      out << "after the step, zero the optimizer's moments (exp_avg, exp_avg_sq, momentum_buffer, "
             "...) of the tensors the step blames, of all when it blames none; step counters "
             "kept (SPAM's reset: pair it with lower_lr for its warm-up)";
      break;
    case Action::kApply:
      out << "apply the step";
      break;
  }
  return out.str();
}

void explain_detectors(const DetectorSettings& d, std::ostream& out) {
  const std::vector<TrendKind>& kinds = trend_kinds();
  bool trends = false;
  for (const TrendSettings& t : d.trends) trends = trends || t.enabled;
  if (!(d.loss_spike.enabled || d.grad_norm_spike.enabled || d.loss_ratio.enabled || trends)) {
    return;
  }
  out << "Detectors:\n";
  auto spike = [&out](const char* what, const SpikeSettings& s) {
    if (s.ema.detrend) {
      out << "  - " << what << " spike: more than " << s.ema.threshold
          << " of its own deviations above the median of its last " << s.ema.recent_window
          << " values (detrended: a falling " << what
          << " does not widen them; their moving average with decay " << s.ema.decay << "), after "
          << s.ema.warmup << " steps of warm-up; spikes do not move them\n";
    } else {
      out << "  - " << what << " spike: more than " << s.ema.threshold
          << " standard deviations above its moving average (decay " << s.ema.decay << "), after "
          << s.ema.warmup << " steps of warm-up; spikes do not move the average\n";
    }
    if (s.ema.early_factor > 0 && s.ema.warmup > s.ema.early_after) {
      out << "    during the warm-up, from step " << s.ema.early_after + 1 << ": a " << what
          << " above " << s.ema.early_factor << "x its running mean\n";
    }
    if (s.ema.recent_factor > 0) {
      out << "    at any step from the third: a " << what << " above " << s.ema.recent_factor
          << "x the median of its last " << s.ema.recent_window
          << " values (the largest rank's, for the loss), beyond their own scatter (a rise of more "
             "than "
          << s.ema.recent_factor << "x the largest rise inside them, and " << kRecentScatter
          << "x their log-spread)\n";
    }
  };
  if (d.loss_spike.enabled) spike("loss", d.loss_spike);
  if (d.grad_norm_spike.enabled) spike("grad-norm", d.grad_norm_spike);
  if (d.loss_ratio.enabled) {
    out << "  - loss ratio: a loss above " << d.loss_ratio.ratio.factor
        << "x the largest loss of the first " << d.loss_ratio.ratio.reference_steps << " steps\n";
  }
  if (d.loss_recovery.enabled) {
    out << "  - loss recovery: after a loss spike, the loss must come back under "
        << d.loss_recovery.factor << "x its level from before the spike within "
        << d.loss_recovery.within << " steps, or loss_not_recovered is raised (again every "
        << d.loss_recovery.within
        << " steps until it does); snapshots taken meanwhile are not trusted\n";
  }
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    if (d.trends[i].enabled) out << "  - " << kinds[i].explain(d.trends[i].values) << "\n";
  }
}

void explain_rules(const PolicyConfig& config, std::ostream& out) {
  if (config.rules.empty()) {
    out << "Rules: none; the built-in ladder applies.\n";
    return;
  }
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
    out << ": " << action_words(r.action, config.detectors);
    if (r.cooldown > 0) out << "; then quiet for " << r.cooldown << " steps";
    out << ".\n";
  }
}

void explain_limits(const Limits& l, const DetectorSettings& d, std::ostream& out) {
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
}

// Loss scaling and checkpoint cadence, when the policy sets them.
void explain_settings(const PolicyConfig& config, std::ostream& out) {
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
}

}  // namespace

namespace detail {

std::string did_you_mean(const std::string& word, const std::vector<std::string>& known) {
  // A word that starts a known one ('skip' -> 'skip_batch') beats a near spelling, and one that
  // is a whole part of a known one ('factor' -> 'early_factor') too.
  if (word.size() >= 3) {
    for (const auto& k : known) {
      if (k.size() > word.size() && k.compare(0, word.size(), word) == 0) {
        return " (did you mean '" + k + "'?)";
      }
    }
  }
  if (word.size() >= 4) {
    for (const auto& k : known) {
      const std::size_t at = k.find(word);
      if (k.size() > word.size() && at != std::string::npos && at > 0 && k[at - 1] == '_') {
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

std::string describe(const YAML::Node& node) {
  if (node.IsScalar()) return "'" + node.Scalar() + "'";
  if (node.IsMap()) return "a map";
  if (node.IsSequence()) return "a list";
  return "nothing";
}

std::string join(const std::vector<std::string>& words) {
  std::string out;
  for (const auto& w : words) out += (out.empty() ? "" : ", ") + w;
  return out;
}

}  // namespace detail

std::string PolicyIssue::format() const {
  std::ostringstream out;
  // No position (a file that cannot be read, a preset name that is none): the name alone.
  out << file;
  if (line > 0) out << ":" << line << ":" << column;
  out << ": " << message;
  return out.str();
}

PolicyFileError::PolicyFileError(std::vector<PolicyIssue> issues)
    : std::runtime_error([&] {
        std::string text;
        for (const auto& i : issues) text += (text.empty() ? "" : "\n") + i.format();
        return text;
      }()),
      issues_(std::move(issues)) {}

std::string explain_policy(const PolicyConfig& config) {
  std::ostringstream out;
  out << "On every step, all gradients and the loss are checked for NaN/Inf in one pass, and all "
         "ranks agree on the result in one all-reduce.\n";
  explain_detectors(config.detectors, out);
  explain_rules(config, out);
  out << "Always: a clean step is applied; a NaN/Inf step is never applied (it is skipped when no "
         "rule does more); under loss scaling, Inf in the gradients of a finite loss while the "
         "scale can still back off is an fp16 overflow (signal overflow, which rules on nonfinite "
         "do not see): skipped, the scale backs off; ranks whose guard state diverged abort "
         "training; a signal no rule acts on is recorded as an alert.\n";
  out << "Combining: abort wins over everything; rollback replaces skip; a step that is not "
         "applied is not clipped; loss-scale and LR changes apply on top (after a rollback's "
         "restore); of one action from several rules, the strongest parameters win.\n";
  explain_limits(config.limits, config.detectors, out);
  explain_settings(config, out);
  return out.str();
}

}  // namespace policy
}  // namespace stepguard
