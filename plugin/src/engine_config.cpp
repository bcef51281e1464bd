#include "plugin/src/engine_config.h"

#include <c10/util/Exception.h>
#include <torch/version.h>

#include <cstdio>
#include <utility>

#include "csrc/consensus/nccl_probe.h"
#include "csrc/inspect/cuda/inspect_cuda.h"
#include "csrc/policy/policy_file.h"
#include "csrc/policy/presets.h"
#include "plugin/src/layout.h"
#include "stepguard/version.h"

namespace stepguard {

namespace {

void check_plain_options(const GuardOptions& o) {
  TORCH_CHECK(o.max_consecutive_bad_steps() >= 0,
              "stepguard: max_consecutive_bad_steps must be >= 0, got ",
              o.max_consecutive_bad_steps());
  TORCH_CHECK(o.checkpoint_every() >= 0, "stepguard: checkpoint_every must be >= 0, got ",
              o.checkpoint_every());
  TORCH_CHECK(o.max_blamed_tensors() >= 0, "stepguard: max_blamed_tensors must be >= 0, got ",
              o.max_blamed_tensors());
  TORCH_CHECK(o.collective_timeout().count() > 0,
              "stepguard: collective_timeout must be positive, got ",
              o.collective_timeout().count(), " ms");
  TORCH_CHECK(o.metrics_port() >= -1 && o.metrics_port() <= 65535,
              "stepguard: metrics_port must be -1 (off), 0 (any free port) or a TCP port, got ",
              o.metrics_port());
  TORCH_CHECK(o.process_group() || !o.store(),
              "stepguard: a store was given without a process group");
  TORCH_CHECK(o.policy().empty() || o.policy_yaml().empty(), "stepguard: both policy ('",
              o.policy(), "') and policy_yaml are set; set one");
  // A NUL would cut the path short at the system call: another file, or every write failing.
  const std::pair<const char*, const std::string*> paths[] = {
      {"policy", &o.policy()},
      {"trace_path", &o.trace_path()},
      {"checkpoint_dir", &o.checkpoint_dir()},
      {"incident_dir", &o.incident_dir()},
      {"run_id", &o.run_id()},
      {"metrics_bind_address", &o.metrics_bind_address()}};
  for (const auto& [name, value] : paths) {
    TORCH_CHECK(value->find('\0') == std::string::npos, "stepguard: ", name,
                " holds a NUL character (at offset ", value->find('\0'),
                "); a path or name cannot");
  }
}

policy::PolicyConfig read_policy(const GuardOptions& o) {
  try {
    if (!o.policy().empty()) {
      // A file, else a shipped preset of that name (load_policy_file reads either); a bare name
      // that is neither gets this message, a path the file's own error.
      TORCH_CHECK(
          !policy::meant_as_preset(o.policy()) || policy::find_policy_preset(o.policy()) != nullptr,
          "stepguard: policy '", o.policy(), "' is neither a file nor a shipped preset",
          policy::preset_suggestion(o.policy()), " (presets: ", policy::policy_preset_names(), ")");
      return policy::load_policy_file(o.policy());
    }
    policy::PolicyConfig config;
    auto issues = policy::parse_policy(o.policy_yaml(), "policy_yaml", &config);
    if (!issues.empty()) throw policy::PolicyFileError(std::move(issues));
    return config;
  } catch (const policy::PolicyFileError& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace

EngineConfig resolve_config(const GuardOptions& o, bool framework_scale) {
  check_plain_options(o);
  EngineConfig c;
  const bool from_policy = !o.policy().empty() || !o.policy_yaml().empty();
  const std::string where =
      o.policy().empty() ? std::string("policy_yaml") : "the policy '" + o.policy() + "'";
  if (from_policy) {
    c.policy = read_policy(o);
    TORCH_CHECK(o.max_consecutive_bad_steps() == 0,
                "stepguard: max_consecutive_bad_steps is set both in GuardOptions and through ",
                where, "; set it in one place");
  } else {
    c.policy.limits.max_consecutive_bad_steps = o.max_consecutive_bad_steps();
  }
  // Loss scaling: a policy section decides; the option may only agree with it.
  TORCH_CHECK(!(o.loss_scaling() && c.policy.has_loss_scale && !c.policy.loss_scale.enabled),
              "stepguard: loss_scaling is on in GuardOptions but ", where,
              " turns loss scaling off (loss_scale.enabled: false); set it in one place");
  c.loss_scaling = o.loss_scaling();
  TORCH_CHECK(!(framework_scale && o.loss_scaling()),
              "stepguard: loss_scaling turns on the guard's own loss scaling, for a loop that "
              "calls guard.scale_loss(loss) before backward; here the framework decides the loss "
              "scale (its own scaler in fp16, none in bf16 or fp32): leave loss_scaling off (a "
              "policy's loss_scale section, a preset's included, is taken as the framework's)");
  c.framework_scale = framework_scale;
  // Disk cadence: the option or the policy's checkpoint.disk_every, not both.
  const std::int64_t policy_every = c.policy.checkpoint.disk_every;
  TORCH_CHECK(o.checkpoint_every() == 0 || policy_every == 0,
              "stepguard: checkpoint_every is set both in GuardOptions (", o.checkpoint_every(),
              ") and through ", where, " (checkpoint.disk_every: ", policy_every,
              "); set it in one place");
  c.disk_every = o.checkpoint_every() > 0 ? o.checkpoint_every() : policy_every;
  TORCH_CHECK(o.checkpoint_dir().empty() || c.disk_every > 0, "stepguard: checkpoint_dir '",
              o.checkpoint_dir(),
              "' is set but no cadence: set checkpoint_every or the policy's "
              "checkpoint.disk_every");
  TORCH_CHECK(!o.checkpoint_dir().empty() || o.checkpoint_every() == 0,
              "stepguard: checkpoint_every is set but checkpoint_dir is empty");
  if (o.checkpoint_dir().empty()) c.disk_every = 0;
  return c;
}

std::unique_ptr<telemetry::Metrics> open_metrics(const GuardOptions& o, int rank,
                                                 double loss_scale_floor,
                                                 std::int64_t checkpoint_every,
                                                 const std::string& policy_text) {
  if (o.metrics_port() < 0) return nullptr;
#if !defined(STEPGUARD_WITH_METRICS)
  (void)rank;
  (void)loss_scale_floor;
  (void)checkpoint_every;
  (void)policy_text;
  TORCH_CHECK(false,
              "stepguard: metrics_port is set but this build has no metrics "
              "(configured with STEPGUARD_WITH_METRICS=OFF)");
#else
  telemetry::MetricsConfig mc;
  mc.bind_address = o.metrics_bind_address();
  mc.port = o.metrics_port();
  mc.run = o.metrics_run_label();
  mc.rank = rank;
  mc.loss_scale_min = loss_scale_floor;
  mc.checkpoint_every = o.checkpoint_dir().empty() ? 0 : checkpoint_every;
  const int nccl = consensus::nccl_version();
  mc.build_labels = {{"version", version()},
                     {"libtorch", TORCH_VERSION},
                     {"cuda", cuda::compiled_with_cuda() ? "yes" : "no"},
                     {"nccl", nccl ? std::to_string(nccl) : "none"}};
  char digest[17];
  std::snprintf(digest, sizeof digest, "%016llx",
                static_cast<unsigned long long>(text_digest(policy_text)));
  mc.policy_labels = {{"policy", !o.policy().empty()        ? o.policy()
                                 : !o.policy_yaml().empty() ? "policy_yaml"
                                                            : "options"},
                      {"digest", digest}};
  mc.policy_text = policy_text;
  std::unique_ptr<telemetry::Metrics> metrics;
  try {
    metrics = std::make_unique<telemetry::Metrics>(mc);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what(), " (GuardOptions::metrics_port, metrics_bind_address)");
  }
  // Say where, once: with port 0 nobody else knows.
  std::fprintf(stderr, "stepguard: serving metrics at http://%s/metrics (run %s, rank %d)\n",
               metrics->endpoint().c_str(), mc.run.c_str(), mc.rank);
  return metrics;
#endif
}

std::unique_ptr<telemetry::EventLog> open_trace(const GuardOptions& o) {
  if (o.trace_path().empty()) return nullptr;
  try {
    return std::make_unique<telemetry::EventLog>(o.trace_path(), o.trace_every_step());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what(), " (GuardOptions::trace_path)");
  }
}

}  // namespace stepguard
