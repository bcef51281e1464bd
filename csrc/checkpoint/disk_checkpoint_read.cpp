// Reading checkpoints back: the manifests, every rank's file checked against its record (size,
// checksum, step, rank, run), the listing and verification of a checkpoint directory. Writing and
// committing are in disk_checkpoint.cpp.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <tuple>

#include "csrc/checkpoint/disk_checkpoint.h"
#include "csrc/checkpoint/disk_checkpoint_internal.h"
#include "csrc/common/safe_file.h"

namespace stepguard {
namespace checkpoint {

namespace fs = std::filesystem;

using detail::kManifest;
using detail::kMaxSmallFile;
using detail::parse_pending_name;
using detail::rank_name;
using detail::read_manifest;
using detail::step_of_dir_name;

namespace {

// The record of one rank file: its size and checksum. Returns false with `problem` set.
bool check_rank_file(const CheckpointEntry& entry, int rank, std::string* payload,
                     std::string* problem, std::int64_t* bytes) {
  const std::int64_t step = entry.step;
  const std::string record_path = entry.dir + "/" + rank_name(rank, "json");
  const std::string file_path = entry.dir + "/" + rank_name(rank, "ckpt");
  std::string record_text;
  std::string why;
  if (!read_regular_file(record_path, kMaxSmallFile, &record_text, &why)) {
    *problem = record_path + ": " + why;
    return false;
  }
  std::int64_t size = 0;
  std::string sum;
  try {
    const auto j = nlohmann::json::parse(record_text);
    size = j.at("bytes").get<std::int64_t>();
    sum = j.at("xxh3_64").get<std::string>();
    // Files of another step or rank copied here would otherwise pass their own checksums.
    if (j.at("step").get<std::int64_t>() != step || j.at("rank").get<std::int64_t>() != rank) {
      *problem = record_path + ": belongs to step " + j.at("step").dump() + ", rank " +
                 j.at("rank").dump() + ", not step " + std::to_string(step) + ", rank " +
                 std::to_string(rank);
      return false;
    }
    // ... and so would a file of another run's checkpoint of the same step.
    if (!entry.run.empty() && j.value("run", std::string()) != entry.run) {
      *problem = record_path + ": belongs to run '" + j.value("run", std::string()) +
                 "', not run '" + entry.run + "'";
      return false;
    }
  } catch (const std::exception& e) {
    *problem = record_path + ": unreadable (" + e.what() + ")";
    return false;
  }
  if (size < 0) {
    *problem = record_path + ": bytes " + std::to_string(size) + " is out of range";
    return false;
  }
  if (!read_regular_file(file_path, size, payload, &why)) {  // its record says how large it may be
    *problem = file_path + ": " + why;
    return false;
  }
  if (static_cast<std::int64_t>(payload->size()) != size) {
    *problem = file_path + ": " + std::to_string(payload->size()) + " bytes, expected " +
               std::to_string(size) + " (truncated or overwritten)";
    return false;
  }
  const std::string actual = checksum_hex(*payload);
  if (actual != sum) {
    *problem = file_path + ": checksum " + actual + ", expected " + sum + " (corrupted)";
    return false;
  }
  *bytes += size;
  return true;
}

}  // namespace

namespace detail {

bool read_manifest(const std::string& dir, CheckpointEntry* entry, std::string* problem) {
  const std::string path = dir + "/" + kManifest;
  std::string text;
  std::string why;
  if (!read_regular_file(path, kMaxSmallFile, &text, &why)) {
    *problem =
        path + ": " +
        (why == std::strerror(ENOENT) ? std::string("missing (the checkpoint was never completed)")
                                      : why);
    return false;
  }
  try {
    const auto j = nlohmann::json::parse(text);
    const int format = j.at("format").get<int>();
    if (format != kDiskFormat && format != kDiskFormatWithoutRun) {
      *problem = path + ": format " + j.at("format").dump() + ", this stepguard reads " +
                 std::to_string(kDiskFormatWithoutRun) + " and " + std::to_string(kDiskFormat);
      return false;
    }
    std::string run;
    if (format == kDiskFormat) {
      run = j.at("run").get<std::string>();
      const std::string bad = run_id_problem(run);
      if (!bad.empty()) {
        *problem = path + ": run: " + bad;
        return false;
      }
    }
    // Every number read from disk is bounded before anything loops over it.
    const auto step = j.at("step").get<std::int64_t>();
    const auto world = j.at("world_size").get<std::int64_t>();
    if (world < 1 || world > kMaxWorldSize) {
      *problem = path + ": world_size " + std::to_string(world) + " is out of range (1 to " +
                 std::to_string(kMaxWorldSize) + ")";
      return false;
    }
    if (step < 0 || step > kMaxStep) {
      *problem = path + ": step " + std::to_string(step) + " is out of range";
      return false;
    }
    const std::int64_t named = step_of_dir_name(std::filesystem::path(dir).filename().string());
    if (named >= 0 && named != step) {
      *problem = path + ": holds step " + std::to_string(step) + " inside the directory of step " +
                 std::to_string(named);
      return false;
    }
    entry->dir = dir;
    entry->step = step;
    entry->world_size = static_cast<int>(world);
    entry->run = run;
  } catch (const std::exception& e) {
    *problem = path + ": unreadable manifest (" + e.what() + ")";
    return false;
  }
  return true;
}

}  // namespace detail

std::vector<CheckpointEntry> list_checkpoints(const std::string& root) {
  std::vector<CheckpointEntry> out;
  for (const auto& report : verify_all(root)) {
    if (report.complete && report.entry.world_size > 0) out.push_back(report.entry);
  }
  return out;
}

std::vector<std::string> runs_under(const std::string& root) {
  // Manifests only: which run a checkpoint belongs to needs none of its rank files.
  std::vector<std::string> runs;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return runs;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (step_of_dir_name(name) < 0) continue;
    CheckpointEntry entry;
    std::string problem;
    if (read_manifest(it->path().string(), &entry, &problem)) runs.push_back(entry.run);
  }
  std::sort(runs.begin(), runs.end());
  runs.erase(std::unique(runs.begin(), runs.end()), runs.end());
  return runs;
}

VerifyReport verify_checkpoint(const CheckpointEntry& entry) {
  VerifyReport report;
  report.entry = entry;
  for (int rank = 0; rank < entry.world_size; ++rank) {
    std::string payload, problem;
    if (!check_rank_file(entry, rank, &payload, &problem, &report.bytes)) {
      report.problems.push_back(problem);
    }
  }
  return report;
}

std::vector<VerifyReport> verify_all(const std::string& root) {
  struct Found {
    std::int64_t step;
    std::string dir;
    std::string pending_run;  // set for a pending directory
    bool pending;
    bool operator<(const Found& o) const { return std::tie(step, dir) < std::tie(o.step, o.dir); }
  };
  std::vector<Found> dirs;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return {};
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    std::int64_t s = step_of_dir_name(name);
    std::string run;
    if (s >= 0 && e.is_directory(ec)) {
      dirs.push_back({s, e.path().string(), "", false});
    } else if (parse_pending_name(name, &s, &run) && e.is_directory(ec)) {
      dirs.push_back({s, e.path().string(), run, true});
    }
  }
  std::sort(dirs.begin(), dirs.end());
  std::vector<VerifyReport> out;
  for (const auto& found : dirs) {
    VerifyReport r;
    r.entry.dir = found.dir;
    r.entry.step = found.step;
    if (found.pending) {
      r.entry.run = found.pending_run;
      r.complete = false;
      r.problems.push_back(found.dir +
                           ": pending (written, never committed: waiting for the next step's "
                           "confirmation, or left by a crash)");
      out.push_back(r);
      continue;
    }
    CheckpointEntry entry;
    std::string problem;
    if (!read_manifest(found.dir, &entry, &problem)) {
      // Only a manifest that does not exist means "never completed"; one that cannot be read
      // (permissions, a FIFO, a directory) is a damaged checkpoint.
      const bool never_completed = !fs::exists(fs::path(found.dir) / kManifest, ec) && !ec &&
                                   ::access(found.dir.c_str(), R_OK | X_OK) == 0;
      r.complete = !never_completed;
      r.problems.push_back(problem);
      out.push_back(r);
      continue;
    }
    out.push_back(verify_checkpoint(entry));
  }
  return out;
}

std::string read_rank_file(const CheckpointEntry& entry, int rank) {
  std::string payload, problem;
  std::int64_t bytes = 0;
  if (rank < 0 || rank >= entry.world_size) {
    throw CheckpointError(entry.dir + ": no rank " + std::to_string(rank) + " (world size " +
                          std::to_string(entry.world_size) + ")");
  }
  if (!check_rank_file(entry, rank, &payload, &problem, &bytes)) {
    throw CheckpointError(problem);
  }
  return payload;
}

}  // namespace checkpoint
}  // namespace stepguard
