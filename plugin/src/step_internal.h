/*
 * Shared by the engine's own .cpp files only (step_engine.cpp, step_exchange.cpp,
 * step_deferred.cpp): the clock of the stage timings, and what a deferred step carries from
 * begin_deferred() to resolve_deferred().
 */
#pragma once

#include <c10/core/Event.h>

#include <chrono>
#include <memory>
#include <optional>

#include "plugin/src/step_engine.h"

namespace stepguard {

using EngineClock = std::chrono::steady_clock;

inline double seconds_since(EngineClock::time_point start) {
  return std::chrono::duration<double>(EngineClock::now() - start).count();
}

/// A step begun without its decision: what the decision will need, kept as it was then (the
/// next step's check_inputs(), probes and gradient watch fill fresh ones meanwhile). Its summed
/// buffer and rank row stay in the engine's step buffer, which the next step resets only after
/// this one is resolved.
struct StepEngine::DeferredStep {
  std::int64_t step = 0;
  Agreed agreed;                     ///< local stats, blame; global filled at resolve
  std::optional<c10::Event> copied;  ///< the host copy's completion, on a device
  bool state_checked = false;
  std::shared_ptr<const forensics::InputCheck> input_check;
  forensics::Probes probes;
  at::Tensor watched_grad_sum;
};

}  // namespace stepguard
