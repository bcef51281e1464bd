/*
 * The policy: detectors that turn agreed statistics into signals, rules that turn signals into
 * actions, limits that stop a loop of futility, and the combination of all that into one
 * Decision per step. configs/policies/README.md is the user's view of the same thing.
 *
 * Deterministic: evaluate() is a pure function of its input (the agreed GlobalStats and facts
 * the guard owns, such as time at the loss-scale floor) and the engine's state, so every rank
 * decides the same. The state is a plain value that encodes to 64-bit words, for snapshots and
 * for the cross-rank digest. The loss scale and LR factor are not kept here: the engine says
 * what to do to them; their owners (csrc/scaling) do it. Not thread-safe.
 */
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/report.h"
#include "csrc/core/stats.h"
#include "csrc/policy/detectors.h"
#include "csrc/policy/trend.h"

namespace stepguard {
namespace policy {

/// Dynamic loss scaling for fp16, as the policy file's `loss_scale` section gives it. Defaults are
/// PyTorch GradScaler's; min_scale 0 means no floor.
struct LossScaleSettings {
  bool enabled = false;
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  std::int64_t hysteresis = 1;
  double min_scale = 0.0;
};

/// One spike detector on a scalar series (EMA z-score).
struct SpikeSettings {
  bool enabled = false;
  EmaZScoreConfig ema;
};

/// Megatron's ratio check on the loss.
struct RatioSettings {
  bool enabled = false;
  RatioRuleConfig ratio;
};

/// The grad norm's early ratio is looser than the loss's: early in training a single batch can
/// lift the grad norm 10-15x its running mean and settle at once (the loss moves 2x).
constexpr double kGradNormEarlyFactor = 30.0;

struct DetectorSettings {
  SpikeSettings loss_spike;
  SpikeSettings grad_norm_spike{false, [] {
                                  EmaZScoreConfig c;
                                  c.early_factor = kGradNormEarlyFactor;
                                  return c;
                                }()};
  RatioSettings loss_ratio;
  /// After a loss spike (loss_spike or loss_ratio), the loss must come back under `factor` x its
  /// level from before the spike within `within` steps, or loss_not_recovered is raised (and again
  /// every `within` steps until it does). `detectors.loss_recovery`.
  struct Recovery {
    bool enabled = false;
    std::int64_t within = 30;
    double factor = 2.0;
  } loss_recovery;
  /// Replica check: every this many steps (and on the step after every incident) the ranks
  /// compare a fingerprint of their parameters; 0 turns it off. `detectors.replica_divergence`.
  std::int64_t replica_every = 100;
  /// The trend detectors (csrc/policy/trend.h), one entry per trend_kinds() entry, in its order.
  std::vector<TrendSettings> trends = default_trend_settings();
};

/// An action and its parameters, as a rule or a limit names it.
struct ActionSpec {
  Action type = Action::kSkipBatch;
  double factor = 0.5;             ///< drop_loss_scale, lower_lr
  double floor = 0.01;             ///< lower_lr: lowest LR factor
  std::int64_t recover_after = 0;  ///< lower_lr: good steps before recovering
  std::int64_t recover_over = 0;   ///< lower_lr: good steps the recovery takes (0 = stays low)
  double z = 0.0;                  ///< clip: target = EMA mean + z * EMA std (0 = detector's z)
  std::int64_t skip_batches = 0;   ///< rollback: batches to drop after the restore
};

/// Signals a rule listens to, as a bit set over Signal.
using SignalSet = std::uint32_t;
constexpr SignalSet bit(Signal s) noexcept { return SignalSet{1} << static_cast<unsigned>(s); }
/// `nonfinite`: a NaN/Inf gradient or loss.
constexpr SignalSet kNonfiniteSignals = bit(Signal::kNonfiniteGrad) | bit(Signal::kNonfiniteLoss);
/// `spike`: any of the three value detectors.
/// Signals that start a recovery watch.
constexpr SignalSet kLossSpikeSignals = bit(Signal::kLossSpike) | bit(Signal::kLossRatio);
constexpr SignalSet kSpikeSignals =
    bit(Signal::kLossSpike) | bit(Signal::kGradNormSpike) | bit(Signal::kLossRatio);

/// One rule: when a signal in `on` is raised and every condition holds, take `action`.
struct Rule;
/// A digest of what the rules' state means: each rule's signals, conditions and action, in
/// order (names left out: renaming a rule keeps its state). Saved with the state.
std::uint64_t rules_digest(const std::vector<Rule>& rules) noexcept;

struct Rule {
  std::string name;  ///< from the file, or "rule <n>" (1-based)
  SignalSet on = 0;
  std::int64_t consecutive = 1;   ///< fires when the signal's streak is a multiple of this
  std::int64_t within_steps = 0;  ///< with within_count: a window of this many steps...
  std::int64_t within_count = 0;  ///< ...holding at least this many raises (0 = no condition)
  std::int64_t after_step = 0;    ///< fires only on steps > this
  std::int64_t cooldown = 0;      ///< steps after firing during which the rule stays quiet
  ActionSpec action;
};

/// A budget over a window: more than `count` events within `window` steps takes `action`.
struct Budget {
  bool enabled = false;
  std::int64_t count = 0;
  std::int64_t window = 0;
  ActionSpec action{Action::kAbort};
};

struct Limits {
  /// Abort after this many bad steps in a row (0 = never).
  std::int64_t max_consecutive_bad_steps = 0;
  Budget max_skips;
  Budget max_rollbacks;
  /// The loss scale at its floor for `steps` consecutive steps takes `action`.
  std::int64_t loss_scale_floor_steps = 0;  ///< 0 = off
  ActionSpec loss_scale_floor_action{Action::kAbort};
};

/// Snapshot and checkpoint cadence, read here and used by the guard's checkpointing.
struct CheckpointCadence {
  std::int64_t snapshot_every = 0;  ///< RAM snapshot every N steps (0 = none)
  std::int64_t snapshot_keep = 2;   ///< RAM snapshots kept
  std::int64_t disk_every = 0;      ///< disk checkpoint every M steps (0 = none)
  std::int64_t disk_keep = 3;       ///< disk checkpoints kept
};

struct PolicyConfig {
  Limits limits;
  DetectorSettings detectors;
  std::vector<Rule> rules;
  /// Present when the file has a `loss_scale` section.
  bool has_loss_scale = false;
  LossScaleSettings loss_scale;
  CheckpointCadence checkpoint;
  /// True when the config came from a file with a `rules` section; otherwise the built-in ladder
  /// (skip every non-finite step) applies.
  bool has_rules = false;

  /// Whether any rule or limit can take `action`.
  bool uses(Action action) const noexcept;
};

/// Per-rule state: the signal's streak, the steps of its most recent raises and the last firing.
struct RuleState {
  std::int64_t streak = 0;
  std::vector<std::int64_t> recent;  ///< newest last; at most within_count entries
  std::int64_t last_fired = 0;       ///< step of the last firing, 0 = never
  std::int64_t fired = 0;            ///< times fired
  bool operator==(const RuleState& o) const noexcept {
    return streak == o.streak && recent == o.recent && last_fired == o.last_fired &&
           fired == o.fired;
  }
};

/// The recovery watch after a loss spike (DetectorSettings::loss_recovery): guard history, like
/// the budgets, so a rollback leaves it as it is.
struct RecoveryWatch {
  std::int64_t started = 0;       ///< step of the spike that began it; 0 = not watching
  std::int64_t window_start = 0;  ///< the current window began here (the spike or the last raise)
  double loss_level = 0.0;        ///< the loss's level before the spike
  double grad_norm_level = 0.0;   ///< the grad norm's EMA mean before the spike
  double loss_now = 0.0;          ///< the loss over the last few steps (an EMA, alpha 1/4)
  std::int64_t escalations = 0;   ///< loss_not_recovered raised in this watch
  bool operator==(const RecoveryWatch& o) const noexcept {
    return started == o.started && window_start == o.window_start && loss_level == o.loss_level &&
           grad_norm_level == o.grad_norm_level && loss_now == o.loss_now &&
           escalations == o.escalations;
  }
};

/// The engine's whole state: what a snapshot stores and ranks compare.
struct EngineState {
  std::int64_t consecutive_bad_steps = 0;
  std::int64_t bad_steps_total = 0;
  EmaZScoreState loss_ema;
  EmaZScoreState grad_norm_ema;
  RatioRuleState loss_ratio;
  std::vector<RuleState> rules;
  std::vector<std::int64_t> recent_skips;      ///< steps of recent skips, newest last
  std::vector<std::int64_t> recent_rollbacks;  ///< steps of recent rollbacks, newest last
  RecoveryWatch watch;
  /// rules_digest() of the policy whose rules `rules` belongs to (0: a state of an earlier
  /// release, which did not record it). Not compared: it names the policy, not the state.
  std::uint64_t rules_digest = 0;
  /// Each trend detector's state, in trend_kinds() order (empty: fresh, or off).
  std::vector<std::vector<double>> trends;

  bool operator==(const EngineState& o) const noexcept {
    return consecutive_bad_steps == o.consecutive_bad_steps &&
           bad_steps_total == o.bad_steps_total && loss_ema == o.loss_ema &&
           grad_norm_ema == o.grad_norm_ema && loss_ratio == o.loss_ratio && rules == o.rules &&
           recent_skips == o.recent_skips && recent_rollbacks == o.recent_rollbacks &&
           watch == o.watch && trends == o.trends;
  }
  /// The state as 64-bit words (doubles by their bits), and back. decode() throws
  /// std::invalid_argument on words that do not describe a state; words of an earlier release
  /// (without the recent windows, the watch or the rules' digest) decode with them empty. The
  /// rule state is positional: a state recorded under other rules (its digest differs from
  /// `digest`) decodes with every rule's state fresh and `*rules_reset` set; one of an earlier
  /// release must hold `rule_count` rules.
  std::vector<std::int64_t> encode() const;
  static EngineState decode(const std::vector<std::int64_t>& words, std::size_t rule_count,
                            std::uint64_t digest, bool* rules_reset = nullptr);
  /// Throws std::invalid_argument naming the value when a count or step is negative or beyond
  /// 2^52, or an average is not a finite number (decode() checks this).
  void check_ranges() const;
  /// Throws std::invalid_argument when a step the state remembers comes after `step`, the step
  /// the state belongs to (a rule that fired "later" would never fire again).
  void check_not_after(std::int64_t step) const;
};

/// What the guard tells the engine about one step, besides the agreed statistics.
struct StepInput {
  std::int64_t step = 0;  ///< 1-based
  GlobalStats stats;
  std::int64_t loss_scale_steps_at_floor = 0;  ///< from the loss scaler, before this step
  /// Loss scaling is on and the scale can still come down (above its floor, or no floor): an
  /// overflow is then the scaler's to handle.
  bool loss_scale_can_drop = false;
  double lr_factor = 1.0;  ///< the guard's LR factor before this step's decision
};

/// What the engine found and decided on one step.
struct Verdict {
  Signals signals;
  Decision decision;
};

/// Raises signals from the agreed statistics and decides what the guard does.
class PolicyEngine {
 public:
  /// Throws std::invalid_argument when the config is inconsistent (a file that passed
  /// `policy check` never is).
  explicit PolicyEngine(PolicyConfig config = {});

  /// Detects, runs the rules and limits, and combines their actions. Updates the state.
  Verdict evaluate(const StepInput& input);

  const PolicyConfig& config() const noexcept { return config_; }
  const EngineState& state() const noexcept { return state_; }
  /// A loss spike's recovery is being watched: snapshots taken now are not confirmed.
  bool watching() const noexcept { return state_.watch.started > 0; }
  void restore(const EngineState& state);
  /// After a rollback: the detectors' averages come back from `state` (they describe the training
  /// being restored); streaks, cooldowns and budgets stay (they describe the guard's history, and a
  /// budget that forgot its rollbacks could never stop a loop of them).
  void restore_detectors(const EngineState& state);

 private:
  void detect(const StepInput& input, Signals* signals);
  /// The recovery watch after a loss spike: starts it, follows the loss, raises
  /// kLossNotRecovered at the end of a window the loss did not come back in.
  void watch_recovery(std::int64_t step, double loss, double level, double grad_norm_level,
                      Signals* signals);
  /// Each trend detector that is on takes its entry of `trends` (resized to one per kind; an
  /// off detector's entry cleared). Throws std::invalid_argument on an entry it cannot take.
  void restore_trends(std::vector<std::vector<double>>& trends);
  /// The trend detectors that are on, each fed the step; raises their signals.
  void detect_trends(const StepInput& input, Signals* signals);
  void run_rules(std::int64_t step, const Signals& signals, std::vector<const Rule*>* fired);
  double clip_target(const ActionSpec& spec) const;

  PolicyConfig config_;
  EngineState state_;
  EmaZScore loss_spike_;
  EmaZScore grad_norm_spike_;
  RatioRule loss_ratio_;
  /// One per trend_kinds() entry; null where the policy leaves it off.
  std::vector<std::unique_ptr<TrendDetector>> trends_;
};

}  // namespace policy
}  // namespace stepguard
