/*
 * Shared by the end-to-end tests of the `stepguard` binary: running it, reading what it wrote
 * (summary JSON, trace lines), and the checks every demo run's summary gets. Not here: any test.
 */
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace stepguard {
namespace demo_test {

struct ProcessResult {
  int status = -1;  // exit status, or 128 + signal
  std::string out;
  std::string err;
};

/// The whole file at `path` ("" when it cannot be read).
std::string slurp(const std::string& path);

/// A path in the test temp dir, unique to the running test.
std::string temp_path(const std::string& name);

/// Runs `stepguard ARGS` (through /bin/sh, stdin from /dev/null) and collects its output.
ProcessResult run_stepguard(const std::string& args);

nlohmann::json read_json(const std::string& path);

/// One JSON value per non-empty line of `text` (a trace, replay's output).
std::vector<nlohmann::json> json_lines(const std::string& text);

/// The "outcome" of every line of the trace at `trace`.
std::vector<std::string> outcomes_in(const std::string& trace);

/// Processes whose command line contains `needle` (read from /proc, so no helper matches itself).
int processes_mentioning(const std::string& needle);

/// What a test expects of a demo run's summary JSON: only the fields set are checked.
struct SummaryCheck {
#define SG_SUMMARY_FIELD(T, name) \
  SummaryCheck& name(T value) {   \
    name##_ = value;              \
    return *this;                 \
  }                               \
  std::optional<T> name##_

  SG_SUMMARY_FIELD(std::int64_t, ranks);
  SG_SUMMARY_FIELD(std::int64_t, steps);
  SG_SUMMARY_FIELD(std::int64_t, applied);
  SG_SUMMARY_FIELD(std::int64_t, skipped);
  SG_SUMMARY_FIELD(std::int64_t, rollbacks);
  SG_SUMMARY_FIELD(std::int64_t, min_rollbacks);  ///< rollbacks >= this
  SG_SUMMARY_FIELD(bool, aborted);
  SG_SUMMARY_FIELD(bool, params_finite);
  SG_SUMMARY_FIELD(bool, outcomes_agree);
  SG_SUMMARY_FIELD(std::int64_t, collectives);
  SG_SUMMARY_FIELD(std::int64_t, step_buffer_bytes);
  SG_SUMMARY_FIELD(std::size_t, param_hashes);  ///< how many (fatal when it differs)
#undef SG_SUMMARY_FIELD

  /// Every rank's parameter hash equals rank 0's (replicas bitwise equal).
  SummaryCheck& replicas_equal() {
    replicas_equal_ = true;
    return *this;
  }
  /// The model learned: the final loss is below 0.8 times the initial loss.
  SummaryCheck& learned() {
    learned_ = true;
    return *this;
  }
  bool replicas_equal_ = false;
  bool learned_ = false;
};

/// Checks `summary` against `check`. A wrong number of parameter hashes is a fatal failure: call
/// it inside ASSERT_NO_FATAL_FAILURE when that should end the test.
void expect_summary(const nlohmann::json& summary, const SummaryCheck& check);

}  // namespace demo_test
}  // namespace stepguard
