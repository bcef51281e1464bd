/*
 * The JSONL event log: one JSON object per line, per step (or per step that was not a plain
 * apply). It is the trace `stepguard replay` reads back. Lines are flushed as written, so a crash
 * loses at most the line being written.
 *
 * Not here: Prometheus metrics.
 */
#pragma once

#include <cstdint>
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
///
/// A trace belongs to one guard while it lives: the file is held with an exclusive lock (flock:
/// released when the guard closes it or its process dies), and a second guard given the same path,
/// in this process or another, is refused. A trace left by an earlier run is never truncated: it is
/// kept as `PATH.1` (or the first free `PATH.N`), so that each file holds one run for replay.
class EventLog {
 public:
  /// Opens `path` for this guard; throws std::runtime_error naming the path when it cannot, or
  /// when a live guard holds it.
  EventLog(const std::string& path, bool every_step);
  ~EventLog();
  EventLog(const EventLog&) = delete;
  EventLog& operator=(const EventLog&) = delete;

  /// Writes one line for `report` unless it is a plain apply and every_step is off.
  /// `tensors` names the offending gradients on this rank (empty when none).
  void record(const StepReport& report, const GlobalStats& stats, const Signals& signals,
              const Decision& decision, const std::vector<std::string>& tensors);

  const std::string& path() const noexcept { return path_; }
  /// Where an earlier run's trace at this path was kept (empty when there was none).
  const std::string& kept_as() const noexcept { return kept_as_; }

 private:
  std::string path_;
  std::string kept_as_;
  bool every_step_;
  int fd_ = -1;
};

}  // namespace telemetry
}  // namespace stepguard
