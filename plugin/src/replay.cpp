#include "stepguard/replay.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <ostream>
#include <stdexcept>

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

// The guard's RAM snapshots as replay sees them: only the decision state, with the same cadence
// and confirmation (a clean next step confirms, a signal discards), so a rollback in a replay
// restores what it restored live.
class DecisionSnapshots {
 public:
  explicit DecisionSnapshots(const policy::CheckpointCadence& c) : cadence_(c) {}
  void on_step(std::int64_t step, bool clean) {
    if (ring_.empty() || ring_.back().confirmed || ring_.back().step != step - 1) return;
    if (clean) {
      ring_.back().confirmed = true;
    } else {
      ring_.pop_back();
    }
  }
  const std::vector<std::int64_t>* rollback(std::int64_t* to_step) {
    while (!ring_.empty() && !ring_.back().confirmed) ring_.pop_back();
    if (ring_.empty()) return nullptr;
    *to_step = ring_.back().step;
    return &ring_.back().words;
  }
  void after(std::int64_t step, Outcome outcome, const StepController& controller) {
    if (cadence_.snapshot_every <= 0 || outcome != Outcome::kApplied ||
        step % cadence_.snapshot_every != 0) {
      return;
    }
    ring_.push_back({step, false, controller.encode()});
    while (static_cast<std::int64_t>(ring_.size()) > cadence_.snapshot_keep) ring_.pop_front();
  }

 private:
  struct Entry {
    std::int64_t step;
    bool confirmed;
    std::vector<std::int64_t> words;
  };
  policy::CheckpointCadence cadence_;
  std::deque<Entry> ring_;
};

}  // namespace

ReplaySummary replay_trace(const ReplayOptions& options, std::ostream& out) {
  const policy::PolicyConfig config = policy::load_policy_file(options.policy_file);
  std::ifstream in(options.trace_file);
  if (!in) {
    throw std::runtime_error(options.trace_file + ": cannot read trace: " + std::strerror(errno));
  }
  StepController controller = [&] {
    try {
      return StepController(config, options.loss_scaling);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(options.policy_file + ": " + e.what());
    }
  }();

  DecisionSnapshots snapshots(config.checkpoint);
  ReplaySummary summary;
  std::string text;
  std::int64_t line_no = 0;
  std::int64_t previous_step = 0;
  while (std::getline(in, text)) {
    ++line_no;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
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

    GlobalStats g;
    g.loss = number_field(j, "loss", std::numeric_limits<double>::quiet_NaN(), options.trace_file,
                          line_no);
    if (!j.contains("loss") && !j.contains("loss_nonfinite_ranks")) {
      throw TraceError(options.trace_file, line_no, "needs 'loss' (a number, or null)");
    }
    g.loss_nonfinite_ranks = count_field(j, "loss_nonfinite_ranks", std::isfinite(g.loss) ? 0 : 1,
                                         options.trace_file, line_no);
    g.grad_norm = number_field(j, "grad_norm", 0.0, options.trace_file, line_no);
    g.nan_count = count_field(j, "nan", 0, options.trace_file, line_no);
    g.inf_count = count_field(j, "inf", 0, options.trace_file, line_no);
    if (!j.contains("nan") && !j.contains("inf")) {
      g.nan_count = count_field(j, "nonfinite", 0, options.trace_file, line_no);
    }
    g.sum_squares_overflow = !std::isfinite(g.grad_norm) && g.nonfinite_count() == 0;
    g.sum_squares = g.grad_norm * g.grad_norm;

    StepDecision d = controller.decide(step, g);
    snapshots.on_step(step, !d.signals.any());
    StepReport report;
    if (d.decision.outcome == Outcome::kRolledBack) {
      // As the guard does: back to the newest confirmed snapshot, or skip when there is none.
      std::int64_t to_step = 0;
      if (const auto* words = snapshots.rollback(&to_step)) {
        controller.rollback_to(*words, d.decision);
        d.loss_scale = controller.loss_scale();
        d.lr_factor = controller.lr_factor();
        report.rolled_back_to = to_step;
        d.decision.reason += " (rolled back to step " + std::to_string(to_step) + ")";
      } else {
        auto& a = d.decision.actions;
        a.erase(std::remove(a.begin(), a.end(), Action::kRollback), a.end());
        a.insert(a.begin(), Action::kSkipBatch);
        d.decision.outcome = Outcome::kSkipped;
        d.decision.reason += " (no confirmed snapshot to roll back to yet: skipped instead)";
      }
    }
    snapshots.after(step, d.decision.outcome, controller);
    report.outcome = d.decision.outcome;
    report.step = step;
    report.loss = g.loss;
    report.grad_norm = g.grad_norm;
    report.nonfinite_count = g.nonfinite_count();
    report.actions = d.decision.actions;
    report.batches_to_skip = d.decision.batches_to_skip;
    report.loss_scale = d.loss_scale;
    report.lr_factor = d.lr_factor;
    out << telemetry::trace_line(report, g, d.signals, d.decision, {}) << '\n';

    ++summary.steps;
    summary.loss_scale = d.loss_scale;
    summary.lr_factor = d.lr_factor;
    switch (report.outcome) {
      case Outcome::kApplied:
        ++summary.applied;
        break;
      case Outcome::kSkipped:
        ++summary.skipped;
        break;
      case Outcome::kRolledBack:
        ++summary.rolled_back;
        break;
      case Outcome::kAborted:
        summary.aborted = true;
        summary.abort_step = step;
        break;
    }
    if (summary.aborted) break;
  }
  if (in.bad()) throw std::runtime_error(options.trace_file + ": read error");
  return summary;
}

}  // namespace stepguard
