// libFuzzer target for the policy-file parser: any bytes give an issue list or a config, never a
// crash, a hang or an exception; a config that parses builds an engine and decides steps.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "csrc/policy/policy_file.h"
#include "plugin/src/step_controller.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace stepguard;
  const std::string text(reinterpret_cast<const char*>(data), size);
  policy::PolicyConfig config;
  const auto issues = policy::parse_policy(text, "fuzz.yaml", &config);
  for (const auto& i : issues) {
    if (i.format().empty()) __builtin_trap();
  }
  if (!issues.empty()) return 0;
  (void)policy::explain_policy(config);
  // A valid policy must build (loss scaling on, so drop_loss_scale is allowed) and decide.
  StepController controller(config, true);
  SnapshotBook snapshots(config.checkpoint.snapshot_every, config.checkpoint.snapshot_keep);
  for (std::int64_t step = 1; step <= 64; ++step) {
    GlobalStats g;
    const std::uint8_t b = data[static_cast<std::size_t>(step) % size];
    g.loss = (b & 1) ? std::numeric_limits<double>::quiet_NaN() : 1.0 + (b >> 4);
    g.loss_nonfinite_ranks = (b & 1) ? 1 : 0;
    g.nan_count = (b & 2) ? 1 : 0;
    g.grad_norm = (b & 4) ? 1000.0 : 1.0 + 0.01 * (b >> 3);
    g.sum_squares = g.grad_norm * g.grad_norm;
    // Rollbacks go to the newest confirmed snapshot, as in a replay.
    const StepDecision d = controller.decide(step, g, &snapshots);
    if (d.decision.actions.empty()) __builtin_trap();
    if (snapshots.due(step, d.decision.outcome)) snapshots.add(step, controller.encode());
    if (d.decision.outcome == Outcome::kAborted) break;
  }
  StepController copy(config, true);
  copy.decode(controller.encode());
  if (copy.encode() != controller.encode()) __builtin_trap();
  return 0;
}
