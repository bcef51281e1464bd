/*
 * Checkpoints on disk: one directory per step holding one file per rank and a manifest.
 *
 *   DIR/step-000000150/rank-00000.ckpt    the rank's payload (opaque bytes here)
 *   DIR/step-000000150/rank-00000.json    its size and XXH3-64 checksum
 *   DIR/step-000000150/MANIFEST.json      step, world size, format; written last
 *
 * Every file is written atomically: a temporary file in the same directory, fsync, rename, fsync
 * of the directory. A checkpoint exists only once its manifest does; it is valid when every rank's
 * file has the size and checksum its record names. Older checkpoints are deleted only after a newer
 * one is complete, keeping the newest `keep`.
 *
 * Torch-free. Errors name the file. Not thread-safe; one writer per rank.
 */
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace stepguard {
namespace checkpoint {

/// The format this build writes and reads (MANIFEST.json's "format").
constexpr int kDiskFormat = 1;  // the manifest and rank-record layout (payload.h has its own)

/// Bounds of the numbers a manifest may hold (beyond any real job; they bound every loop).
constexpr std::int64_t kMaxWorldSize = std::int64_t{1} << 20;
constexpr std::int64_t kMaxStep = std::int64_t{1} << 53;

/// A checkpoint found on disk (it has a readable manifest).
struct CheckpointEntry {
  std::string dir;  ///< DIR/step-NNNNNNNNN
  std::int64_t step = 0;
  int world_size = 0;
};

/// What verifying one checkpoint found.
struct VerifyReport {
  CheckpointEntry entry;
  std::vector<std::string> problems;  ///< one line each, naming the file; empty when valid
  std::int64_t bytes = 0;             ///< payload bytes over all ranks
  bool complete = true;  ///< false: no manifest (never completed; never loaded, not an error)
  bool ok() const noexcept { return problems.empty(); }
};

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The bytes of one file as pieces written in order (no concatenated copy of a large payload).
struct Pieces {
  std::vector<std::pair<const void*, std::size_t>> parts;
  void add(const void* data, std::size_t size) { parts.push_back({data, size}); }
  std::size_t size() const noexcept {
    std::size_t n = 0;
    for (const auto& p : parts) n += p.second;
    return n;
  }
};

/// XXH3-64 of `bytes`, as 16 hex digits.
std::string checksum_hex(const std::string& bytes);
std::string checksum_hex(const Pieces& pieces);

/// Writes `bytes` to `path` atomically (temporary file, fsync, rename, fsync of the directory).
/// Throws CheckpointError naming the path.
void write_file_atomically(const std::string& path, const std::string& bytes);
void write_file_atomically(const std::string& path, const Pieces& pieces);

/// The checkpoint directory of `step` under `root`.
std::string step_dir(const std::string& root, std::int64_t step);

/// Writes rank `rank`'s payload for `step` (file and record). Creates directories as needed.
void write_rank_file(const std::string& root, std::int64_t step, int rank,
                     const std::string& payload);
void write_rank_file(const std::string& root, std::int64_t step, int rank, const Pieces& payload);
/// Writes the manifest of `step` (rank 0, once every rank's file is written): the checkpoint
/// becomes visible. Then deletes complete checkpoints older than the newest `keep`, and
/// incomplete ones (no manifest) older than `step`.
void commit_checkpoint(const std::string& root, std::int64_t step, int world_size, int keep);
/// Removes what exists of `step` (a checkpoint whose state turned out bad).
void discard_checkpoint(const std::string& root, std::int64_t step);

/// Checkpoints under `root` with a manifest, oldest first. A root that does not exist holds none;
/// a manifest that cannot be read is skipped (verify_all reports it).
std::vector<CheckpointEntry> list_checkpoints(const std::string& root);
/// Checks every rank file of `entry` against its record (size, checksum).
VerifyReport verify_checkpoint(const CheckpointEntry& entry);
/// Every step directory under `root`, including those without a readable manifest (reported as
/// problems), oldest first.
std::vector<VerifyReport> verify_all(const std::string& root);
/// Rank `rank`'s payload of `entry`, verified; throws CheckpointError naming the file.
std::string read_rank_file(const CheckpointEntry& entry, int rank);

}  // namespace checkpoint
}  // namespace stepguard
