/*
 * The JSONL event log: one JSON object per line, per step (or per step that was not a plain
 * apply). It is the trace `stepguard replay` reads back. Lines are flushed as written, so a crash
 * loses at most the line being written.
 *
 * Not here: Prometheus metrics.
 */
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "csrc/core/report.h"
#include "csrc/core/stats.h"

namespace stepguard {
namespace telemetry {

/// One trace line (JSON, no newline) for a step: what the guard saw, decided and did. The same
/// format `stepguard replay` prints, so a replay can be compared line by line with a trace.
std::string trace_line(const StepReport& report, const GlobalStats& stats, const Signals& signals,
                       const Decision& decision, const std::vector<std::string>& tensors);

/// Appends step records to a JSONL file. Not thread-safe: one guard writes one log.
class EventLog {
 public:
  /// Opens (truncates) `path`; throws std::runtime_error naming the path when it cannot.
  EventLog(const std::string& path, bool every_step);

  /// Writes one line for `report` unless it is a plain apply and every_step is off.
  /// `tensors` names the offending gradients on this rank (empty when none).
  void record(const StepReport& report, const GlobalStats& stats, const Signals& signals,
              const Decision& decision, const std::vector<std::string>& tensors);

  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
  bool every_step_;
  std::ofstream out_;
};

}  // namespace telemetry
}  // namespace stepguard
