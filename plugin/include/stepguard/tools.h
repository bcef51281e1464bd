/*
 * The engine's offline tools, as the `stepguard` command uses them: policy checks and
 * explanations, checkpoint verification, incident-report rendering, pictures of a run (drawn by
 * the Python tool stepguard.plot). Plain values in, plain values out; nothing here touches a
 * training run.
 */
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace stepguard {

/// Every problem of the policy file at `path`, one "FILE:LINE:COL: message" each, in file order;
/// empty when the file is valid. A `path` that names no file but a shipped preset reads the
/// preset (as GuardOptions::policy does).
std::vector<std::string> check_policy_file(const std::string& path);
/// The policy at `path` (a file or a preset's name) in plain words. Throws std::invalid_argument
/// holding the problems, one per line, when it is not valid.
std::string explain_policy_file(const std::string& path);

/// The shipped policy presets (configs/policies, built in), by name.
std::vector<std::string> policy_preset_names();
/// A shipped preset's YAML text, comments included. Throws std::invalid_argument naming the
/// presets when `name` is none of them.
std::string policy_preset_text(const std::string& name);

/// What verifying one checkpoint directory found.
struct CheckpointStatus {
  std::string dir;  ///< DIR/step-NNNNNNNNN
  std::int64_t step = 0;
  int world_size = 0;
  std::string run;                    ///< the run it belongs to ("" before run ids)
  std::int64_t bytes = 0;             ///< payload bytes over all ranks
  bool complete = true;               ///< false: never committed (pending or no manifest)
  std::vector<std::string> problems;  ///< one line each, naming the file; empty when valid
  bool ok() const noexcept { return problems.empty(); }
};
/// Every step directory under `root`, oldest first, verified (sizes and checksums of every rank's
/// file against the records).
std::vector<CheckpointStatus> verify_checkpoints(const std::string& root);

/// Markdown for an incident report (the JSON text a guard wrote). Throws std::invalid_argument
/// naming `source` when the text is not an incident report.
std::string render_incident_report(const std::string& json_text, const std::string& source);
/// The same for the report file at `path`: a regular file of at most 16 MiB (a FIFO, a device or
/// a larger file is refused without reading it). Throws std::invalid_argument naming `path`.
std::string render_incident_report_file(const std::string& path);

/// Links a picture of the steps around an incident from its report: the report at `report_path`
/// (the .json a guard wrote) gains "picture": `picture_path`, and the Markdown beside it
/// (same stem, .md) is rendered again with the picture in it. Both files are replaced atomically.
/// Throws std::invalid_argument naming the file when it cannot be read or is not a report.
void attach_incident_picture(const std::string& report_path, const std::string& picture_path);

}  // namespace stepguard
