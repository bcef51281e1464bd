// Writing checkpoints: atomic files, the ranks' files and records, the commit that makes a
// checkpoint visible and prunes the run's older ones, and the names of it all on disk. Listing,
// verifying and reading are in disk_checkpoint_read.cpp.
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <new>
#include <nlohmann/json.hpp>

#include "csrc/checkpoint/disk_checkpoint.h"
#include "csrc/checkpoint/disk_checkpoint_internal.h"

namespace stepguard {
namespace checkpoint {

namespace fs = std::filesystem;

using detail::kManifest;
using detail::kMaxSmallFile;
using detail::kPendingTag;
using detail::kTrashPrefix;
using detail::parse_pending_name;
using detail::rank_name;
using detail::read_manifest;
using detail::step_of_dir_name;

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw CheckpointError(path + ": " + what +
                        (errno ? std::string(": ") + std::strerror(errno) : ""));
}

// Renames a checkpoint directory out of sight (atomic, durable) and returns where it went, so a
// crash before it is removed leaves a hidden remnant that the next commit clears, never a damaged
// checkpoint. "" when there was nothing to hide, or it could not be renamed (permissions): then
// it is made incomplete first, durably, and removed in place.
std::string hide_checkpoint_dir(const std::string& root, const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return {};
  const std::string trash = root + "/" + kTrashPrefix + fs::path(dir).filename().string() + "." +
                            std::to_string(::getpid());
  fs::remove_all(trash, ec);
  if (::rename(dir.c_str(), trash.c_str()) != 0) {
    if (fs::remove(fs::path(dir) / kManifest, ec)) sync_directory(dir);
    fs::remove_all(dir, ec);
    return {};
  }
  sync_directory(root);
  return trash;
}

// Hides a checkpoint directory, then removes it now or lists it in `deferred` for later.
void remove_checkpoint_dir(const std::string& root, const std::string& dir,
                           std::vector<std::string>* deferred = nullptr) {
  const std::string hidden = hide_checkpoint_dir(root, dir);
  if (hidden.empty()) return;
  if (deferred != nullptr) {
    deferred->push_back(hidden);
  } else {
    std::error_code ec;
    fs::remove_all(hidden, ec);
  }
}

}  // namespace

namespace detail {

std::string rank_name(int rank, const char* ext) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.%s", rank, ext);
  return name;
}

std::int64_t step_of_dir_name(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() <= 5 || name.size() > 5 + 18) return -1;
  std::int64_t step = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

bool parse_pending_name(const std::string& name, std::int64_t* step, std::string* run) {
  const std::size_t tag = name.find(kPendingTag);
  if (tag == std::string::npos) return false;
  *step = step_of_dir_name(name.substr(0, tag));
  *run = name.substr(tag + std::char_traits<char>::length(kPendingTag));
  return *step >= 0 && run_id_problem(*run).empty();
}

}  // namespace detail

std::string checksum_hex(const std::string& bytes) {
  Pieces pieces;
  pieces.add(bytes.data(), bytes.size());
  return checksum_hex(pieces);
}

std::string checksum_hex(const Pieces& pieces) {
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) throw std::bad_alloc();
  XXH3_64bits_reset(state);
  for (const auto& [data, size] : pieces.parts) XXH3_64bits_update(state, data, size);
  const std::uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016" PRIx64, h);
  return hex;
}

std::string step_dir(const std::string& root, std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%09" PRId64, step);
  return root + "/" + name;
}

std::string pending_dir(const std::string& root, const std::string& run, std::int64_t step) {
  return step_dir(root, step) + kPendingTag + run;
}

std::string run_id_problem(const std::string& run) {
  if (run.empty() || run.size() > 64) return "a run id has 1 to 64 characters";
  for (const char c : run) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return "a run id may hold only letters, digits, '.', '_' and '-'";
  }
  return "";
}

void write_rank_file(const std::string& root, const std::string& run, std::int64_t step, int rank,
                     const std::string& payload) {
  Pieces pieces;
  pieces.add(payload.data(), payload.size());
  write_rank_file(root, run, step, rank, pieces);
}

void write_rank_file(const std::string& root, const std::string& run, std::int64_t step, int rank,
                     const Pieces& payload) {
  const std::string bad = run_id_problem(run);
  if (!bad.empty()) throw CheckpointError(root + ": run id '" + run + "': " + bad);
  const std::string dir = pending_dir(root, run, step);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw CheckpointError(dir + ": cannot create: " + ec.message());
  // The payload first, its record second: a record always describes a complete file of this
  // write. A record left by an earlier attempt at this step (a crash, then a resumed run) goes
  // first, so that a write failing now cannot leave the old file looking whole to the commit.
  const std::string record_path = dir + "/" + rank_name(rank, "json");
  errno = 0;
  if (::unlink(record_path.c_str()) != 0 && errno != ENOENT) {
    fail(record_path, "cannot remove an earlier attempt's record");
  }
  write_file_atomically(dir + "/" + rank_name(rank, "ckpt"), payload);
  nlohmann::json record = {{"rank", rank},
                           {"step", step},
                           {"run", run},
                           {"bytes", static_cast<std::int64_t>(payload.size())},
                           {"xxh3_64", checksum_hex(payload)}};
  write_file_atomically(record_path, record.dump() + "\n");
  sync_directory(root);
}

void commit_checkpoint(const std::string& root, const std::string& run, std::int64_t step,
                       int world_size, int keep, std::vector<std::string>* deferred) {
  const std::string pending = pending_dir(root, run, step);
  const std::string dir = step_dir(root, step);
  // Every rank's file must be there, whole, before the checkpoint may become visible (a rank
  // whose write failed left none; its record names the size). Checksums are the reader's job.
  for (int rank = 0; rank < world_size; ++rank) {
    const std::string record_path = pending + "/" + rank_name(rank, "json");
    std::string text, why;
    std::int64_t expected = -1;
    if (read_regular_file(record_path, kMaxSmallFile, &text, &why)) {
      try {
        expected = nlohmann::json::parse(text).at("bytes").get<std::int64_t>();
      } catch (const std::exception&) {
      }
    }
    std::error_code ec;
    const auto size = fs::file_size(pending + "/" + rank_name(rank, "ckpt"), ec);
    if (expected < 0 || ec || static_cast<std::int64_t>(size) != expected) {
      errno = 0;
      fail(pending, "rank " + std::to_string(rank) +
                        "'s file is missing or incomplete; the checkpoint is not committed");
    }
  }
  nlohmann::json manifest = {{"format", kDiskFormat},
                             {"run", run},
                             {"step", step},
                             {"world_size", world_size},
                             {"writer", "stepguard"}};
  write_file_atomically(pending + "/" + kManifest, manifest.dump(2) + "\n");
  // An older directory of this step (a timeline the run went back from) goes before the new
  // one takes its name; never rewritten in place.
  remove_checkpoint_dir(root, dir, deferred);
  errno = 0;
  if (::rename(pending.c_str(), dir.c_str()) != 0)
    fail(dir, "cannot move the checkpoint into place");
  sync_directory(root);
  // Only now, with the new checkpoint complete on disk, may this run's older ones go.
  std::vector<std::int64_t> complete;
  std::vector<std::string> stale;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    std::int64_t s = 0;
    std::string owner;
    if (name.rfind(kTrashPrefix, 0) == 0) {
      stale.push_back(e.path().string());  // a deletion a crash interrupted
    } else if (parse_pending_name(name, &s, &owner)) {
      // Never committed. One of a later step may be in the making on another rank right now
      // (writes run in the background): it goes at a later commit, or when the run discards it.
      if (owner == run && s < step) stale.push_back(e.path().string());
    } else if ((s = step_of_dir_name(name)) >= 0) {
      CheckpointEntry entry;
      std::string problem;
      if (!read_manifest(e.path().string(), &entry, &problem) || entry.run != run) continue;
      if (s > step) {
        stale.push_back(e.path().string());  // superseded: the run went back to `step`
      } else {
        complete.push_back(s);
      }
    }
  }
  std::sort(complete.begin(), complete.end());
  const auto keep_n = static_cast<std::size_t>(std::max(keep, 1));
  for (std::size_t i = 0; i + keep_n < complete.size(); ++i) {
    stale.push_back(step_dir(root, complete[i]));
  }
  for (const auto& d : stale) {
    if (fs::path(d).filename().string().rfind(kTrashPrefix, 0) != 0) {
      remove_checkpoint_dir(root, d, deferred);
    } else if (deferred != nullptr) {
      deferred->push_back(d);
    } else {
      fs::remove_all(d, ec);
    }
  }
}

void discard_checkpoint(const std::string& root, const std::string& run, std::int64_t step,
                        std::vector<std::string>* deferred) {
  remove_checkpoint_dir(root, pending_dir(root, run, step), deferred);
}

void remove_hidden(const std::vector<std::string>& dirs) noexcept {
  for (const auto& d : dirs) {
    std::error_code ec;
    fs::remove_all(d, ec);  // what is left stays hidden; the next commit clears it
  }
}

}  // namespace checkpoint
}  // namespace stepguard
