#include "csrc/checkpoint/disk_checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>
#include <sstream>

namespace stepguard {
namespace checkpoint {

namespace fs = std::filesystem;

namespace {

constexpr const char* kManifest = "MANIFEST.json";

std::string rank_name(int rank, const char* ext) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.%s", rank, ext);
  return name;
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw CheckpointError(path + ": " + what +
                        (errno ? std::string(": ") + std::strerror(errno) : ""));
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) fail(dir, "cannot open directory to sync it");
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) fail(dir, "fsync of the directory failed");
}

// Reads a regular file whole. Opens without blocking (a FIFO in its place must not hang a
// reader) and refuses anything but a regular file; `why` says what was wrong ("missing" when
// it does not exist).
bool read_whole(const std::string& path, std::string* out, std::string* why) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    *why = errno == ENOENT ? std::string("missing") : std::string(std::strerror(errno));
    return false;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    *why = S_ISDIR(st.st_mode)    ? "a directory, not a file"
           : S_ISFIFO(st.st_mode) ? "a FIFO, not a regular file"
                                  : "not a regular file";
    ::close(fd);
    return false;
  }
  out->resize(static_cast<std::size_t>(st.st_size));
  std::size_t done = 0;
  while (done < out->size()) {
    const ssize_t n = ::read(fd, out->data() + done, out->size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  out->resize(done);
  return true;
}

// Parses "step-NNNNNNNNN"; -1 when the name is not a step directory.
std::int64_t step_of_dir_name(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() <= 5) return -1;
  std::int64_t step = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

// Reads a manifest; returns false with `problem` set when it is missing or unreadable.
bool read_manifest(const std::string& dir, CheckpointEntry* entry, std::string* problem) {
  const std::string path = dir + "/" + kManifest;
  std::string text;
  std::string why;
  if (!read_whole(path, &text, &why)) {
    *problem =
        path + ": " +
        (why == "missing" ? std::string("missing (the checkpoint was never completed)") : why);
    return false;
  }
  try {
    const auto j = nlohmann::json::parse(text);
    if (j.at("format").get<int>() != kDiskFormat) {
      *problem = path + ": format " + j.at("format").dump() + ", this stepguard reads " +
                 std::to_string(kDiskFormat);
      return false;
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
  } catch (const std::exception& e) {
    *problem = path + ": unreadable manifest (" + e.what() + ")";
    return false;
  }
  return true;
}

// The record of one rank file: its size and checksum. Returns false with `problem` set.
bool check_rank_file(const std::string& dir, std::int64_t step, int rank, std::string* payload,
                     std::string* problem, std::int64_t* bytes) {
  const std::string record_path = dir + "/" + rank_name(rank, "json");
  const std::string file_path = dir + "/" + rank_name(rank, "ckpt");
  std::string record_text;
  std::string why;
  if (!read_whole(record_path, &record_text, &why)) {
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
  } catch (const std::exception& e) {
    *problem = record_path + ": unreadable (" + e.what() + ")";
    return false;
  }
  if (!read_whole(file_path, payload, &why)) {
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

// Deletes a checkpoint directory so that a crash part-way leaves it incomplete, never damaged:
// the manifest goes first (durably), then the rest.
void remove_checkpoint_dir(const std::string& dir) {
  std::error_code ec;
  if (fs::remove(fs::path(dir) / kManifest, ec)) fsync_dir(dir);
  fs::remove_all(dir, ec);
}

}  // namespace

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

void write_file_atomically(const std::string& path, const std::string& bytes) {
  Pieces pieces;
  pieces.add(bytes.data(), bytes.size());
  write_file_atomically(path, pieces);
}

void write_file_atomically(const std::string& path, const Pieces& pieces) {
  const fs::path target(path);
  const std::string dir = target.parent_path().empty() ? "." : target.parent_path().string();
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  errno = 0;
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(tmp, "cannot create");
  for (const auto& [data, size] : pieces.parts) {
    const char* bytes = static_cast<const char*>(data);
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = ::write(fd, bytes + done, size - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        ::close(fd);
        ::unlink(tmp.c_str());
        fail(tmp, "write failed");
      }
      done += static_cast<std::size_t>(n);
    }
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    ::unlink(tmp.c_str());
    fail(tmp, "fsync failed");
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    fail(path, "rename failed");
  }
  fsync_dir(dir);
}

std::string step_dir(const std::string& root, std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%09" PRId64, step);
  return root + "/" + name;
}

void write_rank_file(const std::string& root, std::int64_t step, int rank,
                     const std::string& payload) {
  Pieces pieces;
  pieces.add(payload.data(), payload.size());
  write_rank_file(root, step, rank, pieces);
}

void write_rank_file(const std::string& root, std::int64_t step, int rank, const Pieces& payload) {
  const std::string dir = step_dir(root, step);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw CheckpointError(dir + ": cannot create: " + ec.message());
  // The payload first, its record second: a record always describes a complete file.
  write_file_atomically(dir + "/" + rank_name(rank, "ckpt"), payload);
  nlohmann::json record = {{"rank", rank},
                           {"step", step},
                           {"bytes", static_cast<std::int64_t>(payload.size())},
                           {"xxh3_64", checksum_hex(payload)}};
  write_file_atomically(dir + "/" + rank_name(rank, "json"), record.dump() + "\n");
  fsync_dir(root);
}

void commit_checkpoint(const std::string& root, std::int64_t step, int world_size, int keep) {
  const std::string dir = step_dir(root, step);
  nlohmann::json manifest = {
      {"format", kDiskFormat}, {"step", step}, {"world_size", world_size}, {"writer", "stepguard"}};
  write_file_atomically(dir + "/" + kManifest, manifest.dump(2) + "\n");
  // Only now, with a newer complete checkpoint on disk, may older ones go.
  std::vector<std::int64_t> complete;
  std::vector<std::string> stale;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::int64_t s = step_of_dir_name(e.path().filename().string());
    if (s < 0) continue;
    if (fs::exists(e.path() / kManifest)) {
      complete.push_back(s);
    } else if (s < step) {
      stale.push_back(e.path().string());  // never completed: a crash or a discarded state
    }
  }
  std::sort(complete.begin(), complete.end());
  const auto keep_n = static_cast<std::size_t>(std::max(keep, 1));
  for (std::size_t i = 0; i + keep_n < complete.size(); ++i) {
    stale.push_back(step_dir(root, complete[i]));
  }
  for (const auto& d : stale) remove_checkpoint_dir(d);
}

void discard_checkpoint(const std::string& root, std::int64_t step) {
  remove_checkpoint_dir(step_dir(root, step));
}

std::vector<CheckpointEntry> list_checkpoints(const std::string& root) {
  std::vector<CheckpointEntry> out;
  for (const auto& report : verify_all(root)) {
    if (report.complete && report.entry.world_size > 0) out.push_back(report.entry);
  }
  return out;
}

VerifyReport verify_checkpoint(const CheckpointEntry& entry) {
  VerifyReport report;
  report.entry = entry;
  for (int rank = 0; rank < entry.world_size; ++rank) {
    std::string payload, problem;
    if (!check_rank_file(entry.dir, entry.step, rank, &payload, &problem, &report.bytes)) {
      report.problems.push_back(problem);
    }
  }
  return report;
}

std::vector<VerifyReport> verify_all(const std::string& root) {
  std::vector<std::pair<std::int64_t, std::string>> dirs;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return {};
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::int64_t s = step_of_dir_name(e.path().filename().string());
    if (s >= 0 && e.is_directory(ec)) dirs.push_back({s, e.path().string()});
  }
  std::sort(dirs.begin(), dirs.end());
  std::vector<VerifyReport> out;
  for (const auto& [step, dir] : dirs) {
    CheckpointEntry entry;
    std::string problem;
    if (!read_manifest(dir, &entry, &problem)) {
      VerifyReport r;
      r.entry.dir = dir;
      r.entry.step = step;
      r.complete = fs::exists(fs::path(dir) / kManifest, ec);
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
  if (!check_rank_file(entry.dir, entry.step, rank, &payload, &problem, &bytes)) {
    throw CheckpointError(problem);
  }
  return payload;
}

}  // namespace checkpoint
}  // namespace stepguard
