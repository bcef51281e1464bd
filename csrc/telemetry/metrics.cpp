#include "csrc/telemetry/metrics.h"

#include <functional>
#include <stdexcept>

#if defined(STEPGUARD_WITH_METRICS)
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <unistd.h>
#include <chrono>
#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <utility>

#include "csrc/telemetry/http_endpoint.h"
#endif

namespace stepguard {
namespace telemetry {

#if defined(STEPGUARD_WITH_METRICS)
namespace {

std::string host_label(const MetricsConfig& config) {
  if (!config.host.empty()) return config.host;
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "unknown";
  return name;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Registers the metric families of one Metrics, each labelled with the run, rank and host. Used
// by the constructor only; not thread-safe.
class FamilyBuilder {
 public:
  FamilyBuilder(prometheus::Registry* registry, std::map<std::string, std::string> labels)
      : registry_(*registry), labels_(std::move(labels)) {}

  prometheus::Family<prometheus::Counter>& counter(const char* name, const char* help) {
    return prometheus::BuildCounter().Name(name).Help(help).Labels(labels_).Register(registry_);
  }
  prometheus::Gauge* gauge(const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Labels(labels_).Register(registry_).Add(
        {});
  }
  prometheus::Histogram* histogram(const char* name, const char* help,
                                   const prometheus::Histogram::BucketBoundaries& buckets) {
    return &prometheus::BuildHistogram()
                .Name(name)
                .Help(help)
                .Labels(labels_)
                .Register(registry_)
                .Add({}, buckets);
  }
  // An info metric (stepguard_build_info, stepguard_policy_info): always 1, the facts in its
  // labels.
  void info(const char* name, const char* help, const std::map<std::string, std::string>& facts) {
    prometheus::BuildGauge()
        .Name(name)
        .Help(help)
        .Labels(labels_)
        .Register(registry_)
        .Add(facts)
        .Set(1);
  }

 private:
  prometheus::Registry& registry_;
  const std::map<std::string, std::string> labels_;
};

}  // namespace

struct Metrics::State {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<HttpEndpoint> server;
  std::string endpoint;

  std::map<Outcome, prometheus::Counter*> steps;
  std::map<Action, prometheus::Counter*> actions;
  std::map<std::string, prometheus::Counter*> incidents;  // by signal
  prometheus::Counter* nonfinite_steps = nullptr;
  prometheus::Counter* skipped_batches = nullptr;
  prometheus::Counter* rollbacks = nullptr;
  prometheus::Counter* aborts = nullptr;
  prometheus::Gauge* aborted = nullptr;
  prometheus::Gauge* loss_scale = nullptr;
  prometheus::Gauge* loss_scale_min = nullptr;
  prometheus::Gauge* lr_factor = nullptr;
  prometheus::Gauge* loss = nullptr;
  prometheus::Gauge* grad_norm = nullptr;
  prometheus::Gauge* last_step = nullptr;
  prometheus::Gauge* last_applied_step = nullptr;
  prometheus::Gauge* last_applied_time = nullptr;
  prometheus::Gauge* consecutive_bad = nullptr;
  std::map<Cause, prometheus::Counter*> causes;
  prometheus::Counter* snapshots = nullptr;
  prometheus::Gauge* snapshot_bytes = nullptr;
  prometheus::Counter* checkpoints = nullptr;
  prometheus::Gauge* last_checkpoint_step = nullptr;
  prometheus::Gauge* last_checkpoint_time = nullptr;
  prometheus::Counter* checkpoint_failures = nullptr;
  prometheus::Counter* snapshot_failures = nullptr;
  prometheus::Counter* checkpoints_skipped = nullptr;
  prometheus::Histogram* checkpoint_write_seconds = nullptr;
  prometheus::Histogram* inspect_seconds = nullptr;
  prometheus::Histogram* consensus_seconds = nullptr;

  // The families by concern, registered in this order (the order of the exposition).
  void add_step_families(FamilyBuilder* f);
  void add_training_gauges(FamilyBuilder* f);
  void add_cause_family(FamilyBuilder* f);
  void add_recovery_families(FamilyBuilder* f, std::int64_t checkpoint_every);
  void add_duration_histograms(FamilyBuilder* f);
};

// Outcomes of the guarded steps and what the policy did about them.
void Metrics::State::add_step_families(FamilyBuilder* f) {
  auto& step_family = f->counter("stepguard_steps_total", "Guarded optimizer steps, by outcome.");
  for (Outcome o : kAllOutcomes) steps[o] = &step_family.Add({{"outcome", to_string(o)}});
  auto& action_family = f->counter("stepguard_actions_total", "Actions the policy took, by kind.");
  for (Action a : kAllActions) actions[a] = &action_family.Add({{"action", to_string(a)}});
  auto& incident_family =
      f->counter("stepguard_incidents_total", "Steps where a detector fired, by first signal.");
  for (Signal g : kAllSignals)
    incidents[to_string(g)] = &incident_family.Add({{"signal", to_string(g)}});
  nonfinite_steps = &f->counter("stepguard_nonfinite_steps_total",
                                "Steps with a NaN/Inf gradient or loss on any rank.")
                         .Add({});
  skipped_batches = &f->counter("stepguard_skipped_batches_total",
                                "Batches dropped (skipped steps and skips "
                                "after rollbacks).")
                         .Add({});
  rollbacks =
      &f->counter("stepguard_rollbacks_total", "In-process rollbacks to a snapshot.").Add({});
  aborts = &f->counter("stepguard_aborts_total", "Times the policy aborted training.").Add({});
}

// The state of training as of the last step: loss scale, LR factor, loss, norm, step numbers.
void Metrics::State::add_training_gauges(FamilyBuilder* f) {
  aborted = f->gauge("stepguard_aborted", "1 once the policy aborted training, else 0.");
  loss_scale = f->gauge("stepguard_loss_scale", "Current loss scale (1 without loss scaling).");
  loss_scale_min =
      f->gauge("stepguard_loss_scale_min", "Floor of the loss scale (0 without loss scaling).");
  lr_factor = f->gauge("stepguard_lr_factor", "Factor applied to every learning rate.");
  loss = f->gauge("stepguard_loss", "Loss of the last step (mean over ranks).");
  grad_norm = f->gauge("stepguard_grad_norm", "Global L2 norm of the last step's gradients.");
  last_step = f->gauge("stepguard_last_step", "Number of the last guarded step.");
  last_applied_step = f->gauge("stepguard_last_applied_step", "Number of the last applied step.");
  last_applied_time =
      f->gauge("stepguard_last_applied_timestamp_seconds", "Unix time of the last applied step.");
  consecutive_bad = f->gauge("stepguard_consecutive_bad_steps", "Bad steps in a row right now.");
}

void Metrics::State::add_cause_family(FamilyBuilder* f) {
  auto& cause_family = f->counter("stepguard_incident_causes_total",
                                  "Incidents by the root cause forensics assigned.");
  for (Cause c : kAllCauses) {
    causes[c] = &cause_family.Add({{"cause", to_string(c)}});
  }
}

// RAM snapshots and disk checkpoints: how many, how recent, how many failed or were skipped.
void Metrics::State::add_recovery_families(FamilyBuilder* f, std::int64_t checkpoint_every) {
  snapshots = &f->counter("stepguard_snapshots_total", "RAM snapshots taken.").Add({});
  snapshot_bytes =
      f->gauge("stepguard_snapshot_bytes", "Host bytes held by the RAM snapshot ring.");
  checkpoints = &f->counter("stepguard_checkpoints_total",
                            "Disk checkpoints made visible (manifest written).")
                     .Add({});
  last_checkpoint_step =
      f->gauge("stepguard_last_checkpoint_step", "Step of the newest visible disk checkpoint.");
  snapshot_failures = &f->counter("stepguard_snapshot_failures_total",
                                  "RAM snapshots that could not be taken (host memory).")
                           .Add({});
  checkpoints_skipped =
      &f->counter("stepguard_checkpoints_skipped_total",
                  "Disk checkpoints skipped: due while the last one was still being written.")
           .Add({});
  checkpoint_failures = &f->counter("stepguard_checkpoint_failures_total",
                                    "Disk checkpoints that could not be written or committed.")
                             .Add({});
  f->gauge("stepguard_checkpoint_interval_steps",
           "Disk checkpoint cadence in steps (0: no disk checkpoints).")
      ->Set(static_cast<double>(checkpoint_every));
  last_checkpoint_time = f->gauge("stepguard_last_checkpoint_timestamp_seconds",
                                  "Unix time the newest disk checkpoint became visible.");
}

void Metrics::State::add_duration_histograms(FamilyBuilder* f) {
  const prometheus::Histogram::BucketBoundaries buckets = {1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2,
                                                           3e-2, 0.1,  0.3,  1,    3,    10};
  inspect_seconds = f->histogram("stepguard_inspect_duration_seconds",
                                 "Time to inspect all gradients of one step.", buckets);
  checkpoint_write_seconds =
      f->histogram("stepguard_checkpoint_write_duration_seconds",
                   "Time to write one rank's disk checkpoint file.", buckets);
  consensus_seconds = f->histogram("stepguard_consensus_duration_seconds",
                                   "Time of the per-step collective across ranks.", buckets);
}

Metrics::Metrics(const MetricsConfig& config) : state_(std::make_unique<State>()) {
  State& s = *state_;
  FamilyBuilder families(
      s.registry.get(),
      {{"run", config.run}, {"rank", std::to_string(config.rank)}, {"host", host_label(config)}});
  s.add_step_families(&families);
  s.add_training_gauges(&families);
  s.add_cause_family(&families);
  s.add_recovery_families(&families, config.checkpoint_every);
  s.add_duration_histograms(&families);
  families.info("stepguard_build_info", "Build facts of the running stepguard; always 1.",
                config.build_labels);
  families.info("stepguard_policy_info",
                "The guard's active policy (its source and the digest of its ladder, as "
                "/policy gives it in words); always 1.",
                config.policy_labels);
  s.lr_factor->Set(1.0);
  s.loss_scale->Set(1.0);
  s.loss_scale_min->Set(config.loss_scale_min);

  serve(config);
}

void Metrics::serve(const MetricsConfig& config) {
  State& s = *state_;
  try {
    HttpPages pages = {
        {"/metrics", {"text/plain; version=0.0.4; charset=utf-8", [this] { return serialize(); }}},
        {"/policy", {"text/plain; charset=utf-8", [text = config.policy_text] { return text; }}}};
    s.server = std::make_unique<HttpEndpoint>(config.bind_address, config.port, std::move(pages));
  } catch (const std::exception& e) {
    throw std::runtime_error("stepguard: cannot serve metrics on " + config.bind_address + ":" +
                             std::to_string(config.port) + ": " + e.what());
  }
  s.endpoint = config.bind_address + ":" + std::to_string(s.server->port());
}

Metrics::~Metrics() { state_->server.reset(); }

void Metrics::record_step(const StepReport& r, std::int64_t consecutive_bad_steps,
                          double inspect_seconds, double consensus_seconds) {
  State& s = *state_;
  s.steps[r.outcome]->Increment();
  for (Action a : r.actions) s.actions[a]->Increment();
  if (r.incident) {
    auto it = s.incidents.find(to_string(r.incident->signal));
    if (it != s.incidents.end()) it->second->Increment();
  }
  if (r.nonfinite_count > 0 || (r.incident && r.incident->signal == Signal::kNonfiniteLoss)) {
    s.nonfinite_steps->Increment();
  }
  if (r.outcome == Outcome::kSkipped) s.skipped_batches->Increment();
  if (r.batches_to_skip > 0) s.skipped_batches->Increment(static_cast<double>(r.batches_to_skip));
  if (r.outcome == Outcome::kRolledBack) s.rollbacks->Increment();
  if (r.outcome == Outcome::kAborted) record_abort();
  s.loss_scale->Set(r.loss_scale);
  s.lr_factor->Set(r.lr_factor);
  if (std::isfinite(r.loss)) s.loss->Set(r.loss);
  if (std::isfinite(r.grad_norm)) s.grad_norm->Set(r.grad_norm);
  s.last_step->Set(static_cast<double>(r.step));
  if (r.applied()) {
    s.last_applied_step->Set(static_cast<double>(r.step));
    s.last_applied_time->Set(unix_seconds());
  }
  s.consecutive_bad->Set(static_cast<double>(consecutive_bad_steps));
  s.inspect_seconds->Observe(inspect_seconds);
  s.consensus_seconds->Observe(consensus_seconds);
}

void Metrics::record_cause(Cause cause) { state_->causes.at(cause)->Increment(); }

void Metrics::record_snapshot(std::int64_t bytes_held) {
  state_->snapshots->Increment();
  state_->snapshot_bytes->Set(static_cast<double>(bytes_held));
}

void Metrics::record_checkpoint(std::int64_t step, double write_seconds) {
  state_->checkpoints->Increment();
  state_->last_checkpoint_step->Set(static_cast<double>(step));
  state_->last_checkpoint_time->Set(unix_seconds());
  state_->checkpoint_write_seconds->Observe(write_seconds);
}

void Metrics::record_checkpoint_failure() { state_->checkpoint_failures->Increment(); }
void Metrics::record_snapshot_failure() { state_->snapshot_failures->Increment(); }
void Metrics::record_checkpoint_skipped() { state_->checkpoints_skipped->Increment(); }

void Metrics::record_abort() {
  state_->aborts->Increment();
  state_->aborted->Set(1);
}

std::string Metrics::endpoint() const { return state_->endpoint; }

std::string Metrics::serialize() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, state_->registry->Collect());
  return out.str();
}

#else  // built without prometheus-cpp

struct Metrics::State {};
Metrics::Metrics(const MetricsConfig&) {
  throw std::runtime_error("stepguard: this build has no metrics (STEPGUARD_WITH_METRICS=OFF)");
}
Metrics::~Metrics() = default;
void Metrics::record_step(const StepReport&, std::int64_t, double, double) {}
void Metrics::record_abort() {}
void Metrics::record_snapshot(std::int64_t) {}
void Metrics::record_cause(Cause) {}
void Metrics::record_checkpoint(std::int64_t, double) {}
void Metrics::record_checkpoint_failure() {}
void Metrics::record_snapshot_failure() {}
void Metrics::record_checkpoint_skipped() {}
std::string Metrics::endpoint() const { return {}; }
std::string Metrics::serialize() const { return {}; }

#endif

}  // namespace telemetry
}  // namespace stepguard
