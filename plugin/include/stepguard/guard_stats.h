/*
 * What a guard counts and decides from, as plain values: the running totals by outcome and the
 * decision state (step counter plus everything the policy decides from), which snapshots save and
 * restore_state() restores. Shared by the C++ and Python front ends.
 */
#pragma once

#include <cstdint>
#include <vector>

namespace stepguard {

/// Running totals over the guard's life.
struct GuardTotals {
  std::int64_t steps = 0;
  std::int64_t applied = 0;
  std::int64_t skipped = 0;
  std::int64_t rolled_back = 0;  ///< in-process rollbacks to a RAM snapshot
  std::int64_t aborted = 0;
  std::int64_t incidents = 0;
  std::int64_t snapshots = 0;  ///< RAM snapshots taken
};

/// The guard's decision state: the step counter and everything the policy decides from (streaks,
/// detector averages, budgets, loss scale, LR factor). Every rank holds the same one (the step
/// buffer carries a digest of it, so a rank that diverged is found within one step); snapshots
/// save it.
struct GuardState {
  std::int64_t step = 0;
  /// The whole decision state as 64-bit words, opaque; what restore_state() restores. Empty
  /// restores the state of a new guard.
  std::vector<std::int64_t> words;
  // Readable views of `words`, for logs and tests (restore_state() ignores them).
  std::int64_t consecutive_bad_steps = 0;
  std::int64_t bad_steps_total = 0;
  double loss_scale = 1.0;  ///< 1 without loss scaling
  double lr_factor = 1.0;
  bool operator==(const GuardState& o) const noexcept { return step == o.step && words == o.words; }
};

}  // namespace stepguard
