/*
 * Prometheus metrics of one guard: a prometheus-cpp registry with every family created once at
 * start-up and every label set pre-created at zero (so rate() and absent() behave from the first
 * scrape), served over HTTP at /metrics on 127.0.0.1 unless told otherwise, beside /policy (the
 * guard's active policy in plain words). Names follow Prometheus
 * conventions: the stepguard_ prefix, _total counters, base units (seconds), no step or batch
 * labels; constant labels `run` and `rank` tell jobs and ranks apart.
 *
 * Not here: deciding anything, or the JSONL event log (event_log.h).
 */
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "csrc/core/report.h"
#include "csrc/core/stats.h"

namespace stepguard {
namespace telemetry {

struct MetricsConfig {
  std::string bind_address = "127.0.0.1";
  /// TCP port of the /metrics endpoint; 0 picks a free one (see Metrics::endpoint()).
  int port = 0;
  /// Constant labels on every series.
  std::string run = "stepguard";
  int rank = 0;
  /// The machine, so that a page names it (default: this host's name).
  std::string host;
  /// Disk checkpoint cadence in steps (0: none), for the stale-checkpoint alert.
  std::int64_t checkpoint_every = 0;
  /// Floor of the loss scale (0 without loss scaling or floor), for the at-floor alert.
  double loss_scale_min = 0.0;
  /// Labels of stepguard_build_info.
  std::map<std::string, std::string> build_labels;
  /// Labels of stepguard_policy_info (the policy's source and digest).
  std::map<std::string, std::string> policy_labels;
  /// The active policy in plain words, served at /policy.
  std::string policy_text;
};

/// Thread-safety: record_* are called by the one training thread; scrapes run on the endpoint's
/// own thread and read the registry, which prometheus-cpp synchronizes.
class Metrics {
 public:
  /// Creates the families and starts serving; throws std::runtime_error naming the address when
  /// the port cannot be bound.
  explicit Metrics(const MetricsConfig& config);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  /// One guarded step: what happened, the streak after it, and how long inspection and the
  /// collective took.
  void record_step(const StepReport& report, std::int64_t consecutive_bad_steps,
                   double inspect_seconds, double consensus_seconds);
  /// An incident was classified.
  void record_cause(Cause cause);
  /// A RAM snapshot was taken; `bytes_held` is what the ring holds now.
  void record_snapshot(std::int64_t bytes_held);
  /// A disk checkpoint of `step` became visible; `write_seconds` is what writing it took.
  void record_checkpoint(std::int64_t step, double write_seconds);
  /// A disk checkpoint could not be written or committed (training went on).
  void record_checkpoint_failure();
  /// A RAM snapshot that could not be taken (training went on without it).
  void record_snapshot_failure();
  /// A disk checkpoint was due while the last one was still being written: skipped.
  void record_checkpoint_skipped();
  /// "address:port" where /metrics is served.
  std::string endpoint() const;
  /// The current exposition text, as a scrape would see it.
  std::string serialize() const;

 private:
  void serve(const MetricsConfig& config);
  void record_abort();

  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace telemetry
}  // namespace stepguard
