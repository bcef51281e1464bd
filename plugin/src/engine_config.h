/*
 * The one place GuardOptions become what the engine runs with: the policy (from the file, the
 * YAML text or the built-in ladder) with every knob that exists both as an option and in the
 * policy reconciled once, here, and the telemetry the options ask for. Errors a user can cause are
 * c10::Error naming the option or file. Nothing reads two sources at run time.
 *
 * Internal to the engine. Thread-compatible.
 */
#pragma once

#include <memory>
#include <string>

#include "csrc/policy/policy.h"
#include "csrc/telemetry/event_log.h"
#include "csrc/telemetry/metrics.h"
#include "stepguard/options.h"

namespace stepguard {

/// The policy a guard runs and the knobs reconciled with it.
struct EngineConfig {
  policy::PolicyConfig policy;
  bool loss_scaling = false;     ///< the default when the policy has no loss_scale section
  bool framework_scale = false;  ///< a framework decides the loss scale: the guard scales nothing
  std::int64_t disk_every = 0;   ///< disk checkpoint cadence (0: none)
};

/// Validates `options` and resolves the policy. Throws c10::Error naming the option, or the
/// policy's problems as `FILE:LINE:COL: message` lines. `framework_scale`: a framework decides
/// the loss scale (OptimizerPort::owns_loss_scale), so the guard's own scaling is refused.
EngineConfig resolve_config(const GuardOptions& options, bool framework_scale = false);

/// The Prometheus endpoint the options ask for (labelled with `rank`), or null; it serves
/// `policy_text` (the active policy in words) at /policy and names its source and digest in
/// stepguard_policy_info. Throws c10::Error naming the address when it cannot be served.
std::unique_ptr<telemetry::Metrics> open_metrics(const GuardOptions& options, int rank,
                                                 double loss_scale_floor,
                                                 std::int64_t checkpoint_every,
                                                 const std::string& policy_text);

/// The JSONL trace the options ask for, or null. Throws c10::Error naming trace_path.
std::unique_ptr<telemetry::EventLog> open_trace(const GuardOptions& options);

}  // namespace stepguard
