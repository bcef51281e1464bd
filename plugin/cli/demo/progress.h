/*
 * The demo's live progress on stderr: one rewritten line on a terminal, a plain line every N
 * steps otherwise, and notes (incidents, kills) between them. Not here: the final summary.
 */
#pragma once

#include <stepguard/stepguard.h>
#include <chrono>
#include <cstdint>
#include <string>

namespace stepguard {
namespace demo {

/// Live progress of one rank's run. Not thread-safe: the training loop's thread alone uses it.
class Progress {
 public:
  /// `log_every` 0: a plain line every tenth of the run off a terminal.
  Progress(std::int64_t total, std::int64_t log_every);
  /// Shows step `r` (rate-limited on a terminal). The guard's totals are read (stats(), which
  /// waits for a snapshot copy in flight) only when a line is drawn, not every step.
  void update(const StepReport& r, double tokens_per_s, const GuardedOptimizer& guard);
  /// A line of its own, clearing the progress line first on a terminal.
  void note(const std::string& line);

 private:
  std::int64_t total_;
  bool tty_;
  std::int64_t every_ = 1;
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace demo
}  // namespace stepguard
