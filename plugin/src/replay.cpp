#include "stepguard/replay.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <ostream>
#include <stdexcept>

#include "csrc/common/json_text.h"
#include "csrc/common/safe_file.h"
#include "csrc/policy/policy_file.h"
#include "csrc/telemetry/event_log.h"
#include "plugin/src/step_controller.h"

namespace stepguard {

namespace {

class TraceError : public std::runtime_error {
 public:
  TraceError(const std::string& file, std::int64_t line, const std::string& message)
      : std::runtime_error(file + ":" + std::to_string(line) + ": " + message) {}
};

// A number field: absent -> fallback, null -> NaN (the trace writes non-finite numbers as null).
double number_field(const nlohmann::json& j, const char* key, double fallback,
                    const std::string& file, std::int64_t line) {
  auto it = j.find(key);
  if (it == j.end()) return fallback;
  if (it->is_null()) return std::numeric_limits<double>::quiet_NaN();
  if (!it->is_number()) {
    throw TraceError(file, line,
                     std::string("'") + key + "' must be a number or null, got " + it->dump());
  }
  return it->get<double>();
}

std::int64_t count_field(const nlohmann::json& j, const char* key, std::int64_t fallback,
                         const std::string& file, std::int64_t line) {
  auto it = j.find(key);
  if (it == j.end()) return fallback;
  if (!it->is_number_integer() || it->get<std::int64_t>() < 0) {
    throw TraceError(file, line,
                     std::string("'") + key + "' must be a whole number >= 0, got " + it->dump());
  }
  return it->get<std::int64_t>();
}

// The agreed statistics a trace line records.
GlobalStats stats_of_line(const nlohmann::json& j, const std::string& file, std::int64_t line) {
  GlobalStats g;
  g.loss = number_field(j, "loss", std::numeric_limits<double>::quiet_NaN(), file, line);
  if (!j.contains("loss") && !j.contains("loss_nonfinite_ranks")) {
    throw TraceError(file, line, "needs 'loss' (a number, or null)");
  }
  g.loss_nonfinite_ranks =
      count_field(j, "loss_nonfinite_ranks", std::isfinite(g.loss) ? 0 : 1, file, line);
  g.grad_norm = number_field(j, "grad_norm", 0.0, file, line);
  g.nan_count = count_field(j, "nan", 0, file, line);
  g.inf_count = count_field(j, "inf", 0, file, line);
  if (!j.contains("nan") && !j.contains("inf")) {
    g.nan_count = count_field(j, "nonfinite", 0, file, line);
  }
  g.loss_max_bound = number_field(j, "loss_max_bound", g.loss, file, line);
  if (auto it = j.find("overflow_ruled_out"); it != j.end()) {
    if (!it->is_boolean()) {
      throw TraceError(file, line, "'overflow_ruled_out' must be true or false, got " + it->dump());
    }
    g.overflow_ruled_out = it->get<bool>();
  }
  const std::int64_t world = count_field(j, "world_size", 1, file, line);
  if (world < 1 || world > (std::int64_t{1} << 30)) {
    throw TraceError(
        file, line,
        "'world_size' must be a whole number in [1, 2^30], got " + std::to_string(world));
  }
  g.world_size = static_cast<int>(world);
  g.loss_given_ranks = count_field(j, "loss_given_ranks", g.world_size, file, line);
  g.largest_lr =
      number_field(j, "largest_lr", std::numeric_limits<double>::quiet_NaN(), file, line);
  g.state_checked = j.contains("state_bad");
  g.state_bad_count = count_field(j, "state_bad", 0, file, line);
  g.framework_loss_scale = number_field(j, "framework_loss_scale", 0.0, file, line);
  g.framework_min_scale = number_field(j, "framework_min_scale", 0.0, file, line);
  g.sum_squares_overflow = !std::isfinite(g.grad_norm) && g.nonfinite_count() == 0;
  g.sum_squares = g.grad_norm * g.grad_norm;
  return g;
}

void count(const StepReport& report, ReplaySummary* summary) {
  ++summary->steps;
  summary->loss_scale = report.loss_scale;
  summary->lr_factor = report.lr_factor;
  switch (report.outcome) {
    case Outcome::kApplied:
      ++summary->applied;
      break;
    case Outcome::kSkipped:
      ++summary->skipped;
      break;
    case Outcome::kRolledBack:
      ++summary->rolled_back;
      break;
    case Outcome::kAborted:
      summary->aborted = true;
      summary->abort_step = report.step;
      break;
  }
}

}  // namespace

ReplaySummary replay_trace(const ReplayOptions& options, std::ostream& out) {
  const policy::PolicyConfig config = policy::load_policy_file(options.policy_file);
  // A trace is one JSON line per step: a FIFO or a device is refused unread, a line past a
  // megabyte (no writer makes one) stops the replay instead of filling memory.
  constexpr std::int64_t kMaxTraceBytes = std::int64_t{64} << 30;
  constexpr std::size_t kMaxTraceLine = std::size_t{1} << 20;
  RegularFileLines in(options.trace_file, kMaxTraceBytes, kMaxTraceLine, "trace");
  StepController controller = [&] {
    try {
      return StepController(config, options.loss_scaling, options.framework_scale);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(options.policy_file + ": " + e.what());
    }
  }();

  // Replay holds no copies: the book alone answers, with the newest confirmed snapshot (the one
  // a live run restores).
  SnapshotBook snapshots(config.checkpoint.snapshot_every, config.checkpoint.snapshot_keep);
  ReplaySummary summary;
  std::string text;
  std::int64_t line_no = 0;
  std::int64_t previous_step = 0;
  while (in.next(&text)) {
    ++line_no;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = parse_json_bounded(text);
    } catch (const std::exception& e) {
      throw TraceError(options.trace_file, line_no, std::string("not a JSON object: ") + e.what());
    }
    if (!j.is_object()) throw TraceError(options.trace_file, line_no, "not a JSON object");
    auto step_it = j.find("step");
    if (step_it == j.end() || !step_it->is_number_integer() ||
        step_it->get<std::int64_t>() <= previous_step) {
      throw TraceError(options.trace_file, line_no,
                       "'step' must be a whole number above the previous line's (" +
                           std::to_string(previous_step) + ")");
    }
    const std::int64_t step = step_it->get<std::int64_t>();
    previous_step = step;

    const GlobalStats g = stats_of_line(j, options.trace_file, line_no);

    const StepDecision d = controller.decide(step, g, &snapshots);
    if (snapshots.due(step, d.decision.outcome)) snapshots.add(step, controller.encode());
    const StepReport report = make_report(step, g, d);
    out << telemetry::trace_line(report, g, d.signals, d.decision, {}) << '\n';

    count(report, &summary);
    if (summary.aborted) break;
  }
  return summary;
}

}  // namespace stepguard
