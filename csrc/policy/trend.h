/*
 * Trend detectors: the slow faults a spike test cannot see (a loss that rises smoothly, training
 * that stopped moving, one rank's loss standing apart), each judged from the agreed figures of
 * one step and a window of its own history, so every rank raises the same signals.
 *
 * A detector is one TrendKind: its name in the policy file's `detectors` section (also its
 * signal's name), its fields with their ranges and defaults, the cause and first fixes its
 * incident names, the sentence `policy explain` prints, and a factory for its TrendDetector, in a
 * file of its own (trend_*.cpp) listed once in trend_kinds(). The policy reader, the checks,
 * `policy explain`, the engine, the state encoding and forensics loop over that table: a new
 * detector is its file, one line in the table, its signal in vocabulary.h and its docs.
 *
 * Deterministic; a detector's state is a plain list of doubles (counts are whole numbers below
 * 2^52) that snapshots, checkpoints and the cross-rank digest carry. Not thread-safe.
 */
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "csrc/core/stats.h"
#include "csrc/core/vocabulary.h"

namespace stepguard {
namespace policy {

/// What a trend detector sees of one step (the same on every rank).
struct TrendInput {
  std::int64_t step = 0;
  const GlobalStats* stats = nullptr;
  /// The loss (when given) and every gradient are finite: the step's figures can be judged.
  bool judged = false;
  double lr_factor = 1.0;  ///< the guard's LR factor for this step
  /// A loss spike's recovery is being watched (detectors.loss_recovery): the training is
  /// suspect and that watch's business; the loss detectors here do not raise meanwhile.
  bool watching = false;
};

class TrendDetector {
 public:
  virtual ~TrendDetector() = default;
  /// Fed every step, in order; true when the signal is raised on this step, with `note` filled.
  virtual bool observe(const TrendInput& in, TrendNote* note) = 0;
  /// The state as doubles, and back. restore() takes an empty state as a fresh one and throws
  /// std::invalid_argument naming what is wrong with any other it cannot take.
  virtual std::vector<double> state() const = 0;
  virtual void restore(const std::vector<double>& state) = 0;
};

/// One setting of a trend detector in the policy file.
struct TrendField {
  const char* name;
  double low;       ///< inclusive
  double high;      ///< inclusive
  double fallback;  ///< the default
  bool whole;       ///< a whole number (a count of steps)
};

struct TrendKind {
  const char* key;  ///< in `detectors`, and the name of `signal`
  Signal signal;
  Cause cause;  ///< what forensics names when this signal alone explains the incident
  std::vector<TrendField> fields;
  std::vector<std::string> fixes;  ///< what to try first, for the incident report
  /// `policy explain`'s sentence for the detector with these field values.
  std::string (*explain)(const std::vector<double>& values);
  std::unique_ptr<TrendDetector> (*make)(const std::vector<double>& values);
  /// The detector reads the optimizer's largest learning rate (GlobalStats::largest_lr): the
  /// engine asks the port for it only while such a detector is on.
  bool reads_lr = false;
  /// The detector reads the optimizer state check (GlobalStats::state_bad_count): the engine
  /// inspects the state, every `fields[0]` steps, only while such a detector is on.
  bool reads_state = false;
};

/// Every trend detector, in a fixed order (the state's and the settings' order).
const std::vector<TrendKind>& trend_kinds();
/// The kind raising `signal`, or nullptr.
const TrendKind* trend_kind(Signal signal);

/// A trend detector as a policy configures it: on or off, its fields in the kind's order.
struct TrendSettings {
  bool enabled = false;
  std::vector<double> values;
};
/// One entry per kind, off, with the fields' defaults.
std::vector<TrendSettings> default_trend_settings();
/// Whether a detector that is on in `settings` (one entry per kind) reads the learning rate.
bool trends_read_lr(const std::vector<TrendSettings>& settings);
/// Every how many steps the engine checks the optimizer state (0: never), from the detector
/// that reads it (detectors.optimizer_state's `every`).
std::int64_t state_check_every(const std::vector<TrendSettings>& settings);

// The kinds, each defined in its own file.
TrendKind loss_trend_kind();       // trend_loss.cpp
TrendKind stall_kind();            // trend_stall.cpp
TrendKind rank_loss_shift_kind();  // trend_rank_shift.cpp
TrendKind optimizer_state_kind();  // trend_state.cpp

namespace trend_detail {
/// A kind's factory: the detector of class T for the policy's field values.
template <typename T>
std::unique_ptr<TrendDetector> make(const std::vector<double>& values) {
  return std::make_unique<T>(values);
}
/// A whole number from a state word, checked to be in [0, 2^52]; throws naming `what`.
std::int64_t count_of(double word, const char* what);
/// A finite number from a state word; throws naming `what`.
double finite_of(double word, const char* what);
/// "12.3" for a figure in a sentence (6 significant digits).
std::string figure(double v);
}  // namespace trend_detail

}  // namespace policy
}  // namespace stepguard
