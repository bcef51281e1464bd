/*
 * The policy: detectors that turn agreed statistics into signals, and the engine that turns
 * signals into a decision. This first version knows one ladder: skip the batch when anything is
 * non-finite, and abort when too many bad steps come in a row (a loop of futility). The YAML
 * schema, spike detectors and the full action set extend this file's types.
 *
 * Deterministic: decide() is a pure function of GlobalStats and the engine's state, so every rank
 * decides the same. Not thread-safe.
 */
#pragma once

#include <cstdint>
#include <string>

#include "stepguard/types.h"

namespace stepguard {
namespace policy {

/// The knobs of the built-in ladder.
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

struct PolicyConfig {
  /// Abort after this many consecutive bad steps (0 = never abort, skip forever).
  std::int64_t max_consecutive_bad_steps = 0;
  /// Present when the file has a `loss_scale` section.
  bool has_loss_scale = false;
  LossScaleSettings loss_scale;
};

/// The engine's whole state: what a snapshot stores and ranks compare.
struct EngineState {
  std::int64_t consecutive_bad_steps = 0;
  std::int64_t bad_steps_total = 0;
  bool operator==(const EngineState& o) const noexcept {
    return consecutive_bad_steps == o.consecutive_bad_steps && bad_steps_total == o.bad_steps_total;
  }
};

/// Raises signals from the agreed statistics and decides what the guard does.
class PolicyEngine {
 public:
  explicit PolicyEngine(PolicyConfig config = {});

  /// Updates the detectors with one step's global statistics and returns what they raised.
  Signals detect(const GlobalStats& stats);
  /// Decides one step from the signals of detect(). Pure in (signals, state).
  Decision decide(const Signals& signals) const;

  const PolicyConfig& config() const noexcept { return config_; }
  const EngineState& state() const noexcept { return state_; }
  void restore(const EngineState& state) { state_ = state; }

 private:
  PolicyConfig config_;
  EngineState state_;
};

}  // namespace policy
}  // namespace stepguard
