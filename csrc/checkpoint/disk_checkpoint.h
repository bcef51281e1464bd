/*
 * Checkpoints on disk: one directory per step holding one file per rank and a manifest.
 *
 *   DIR/step-000000150/rank-00000.ckpt    the rank's payload (opaque bytes here)
 *   DIR/step-000000150/rank-00000.json    its size and XXH3-64 checksum
 *   DIR/step-000000150/MANIFEST.json      run, step, world size, format; written last
 *
 * Every checkpoint belongs to a run (an id in its manifest and records). The ranks write into a
 * pending directory of the run (DIR/step-000000150.pending.RUN), never into a visible one; the
 * commit writes the manifest there and renames the directory into place, so a checkpoint is
 * visible only once it is whole and confirmed, and an older directory of the same step is never
 * rewritten in place. Every file is written atomically: a temporary file in the same directory,
 * fsync, rename, fsync of the directory. A checkpoint is valid when every rank's file has the size
 * and checksum its record names. Pruning after a commit touches only the committing run's
 * checkpoints: those of later steps (a timeline the run went back from) and all but the newest
 * `keep`. Deleted directories are first renamed out of sight, so a crash never leaves a damaged
 * checkpoint that looks whole.
 *
 * Torch-free. Errors name the file. Not thread-safe; one writer per rank.
 */
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "csrc/common/safe_file.h"

namespace stepguard {
namespace checkpoint {

/// The format this build writes and reads (MANIFEST.json's "format").
constexpr int kDiskFormat = 2;  // the manifest and rank-record layout (payload.h has its own)
/// Format 1 (before run ids) is still read; its checkpoints belong to the run "".
constexpr int kDiskFormatWithoutRun = 1;

/// Bounds of the numbers a manifest may hold (beyond any real job; they bound every loop).
constexpr std::int64_t kMaxWorldSize = std::int64_t{1} << 20;
constexpr std::int64_t kMaxStep = std::int64_t{1} << 53;

/// A checkpoint found on disk (it has a readable manifest).
struct CheckpointEntry {
  std::string dir;  ///< DIR/step-NNNNNNNNN (or a pending directory, which is never loaded)
  std::int64_t step = 0;
  int world_size = 0;
  std::string run;  ///< the run it belongs to ("" for format 1)
};

/// What verifying one checkpoint found.
struct VerifyReport {
  CheckpointEntry entry;
  std::vector<std::string> problems;  ///< one line each, naming the file; empty when valid
  std::int64_t bytes = 0;             ///< payload bytes over all ranks
  bool complete = true;  ///< false: never committed (no manifest, or still pending); never loaded
  bool ok() const noexcept { return problems.empty(); }
};

/// An error about a checkpoint file or folder, naming it (the file layer's error: one type).
using CheckpointError = ::stepguard::FileError;
using ::stepguard::Pieces;
using ::stepguard::write_file_atomically;

/// XXH3-64 of `bytes`, as 16 hex digits.
std::string checksum_hex(const std::string& bytes);
std::string checksum_hex(const Pieces& pieces);

/// The checkpoint directory of `step` under `root`.
std::string step_dir(const std::string& root, std::int64_t step);
/// Where the ranks of `run` write `step` before it is committed.
std::string pending_dir(const std::string& root, const std::string& run, std::int64_t step);

/// A run id: 1 to 64 of [A-Za-z0-9._-]. Returns the problem, or "" when `run` is one.
std::string run_id_problem(const std::string& run);

/// Writes rank `rank`'s payload for `step` of `run` (file and record) into the run's pending
/// directory. Creates directories as needed. A record of this rank already there (an earlier
/// attempt at the step) is removed first.
void write_rank_file(const std::string& root, const std::string& run, std::int64_t step, int rank,
                     const std::string& payload);
void write_rank_file(const std::string& root, const std::string& run, std::int64_t step, int rank,
                     const Pieces& payload);
/// Commits `step` of `run` (rank 0, once every rank's file is written): writes the manifest and
/// renames the pending directory into place, replacing an older directory of that step. Then
/// deletes the run's checkpoints of later steps, all but its newest `keep`, and its pending
/// directories of earlier steps (a later one may be in the making on another rank); other runs'
/// checkpoints are never touched. Whatever goes is first renamed out of sight, durably; with
/// `deferred` it is only listed there for remove_hidden() to delete later (off the caller's
/// thread: deleting a large checkpoint takes a while), otherwise deleted before this returns.
void commit_checkpoint(const std::string& root, const std::string& run, std::int64_t step,
                       int world_size, int keep, std::vector<std::string>* deferred = nullptr);
/// Removes the pending `step` of `run` (a checkpoint whose state turned out bad); `deferred` as
/// for commit_checkpoint().
void discard_checkpoint(const std::string& root, const std::string& run, std::int64_t step,
                        std::vector<std::string>* deferred = nullptr);
/// Deletes directories commit_checkpoint() or discard_checkpoint() hid. Never throws: what is
/// left stays hidden and the next commit clears it.
void remove_hidden(const std::vector<std::string>& dirs) noexcept;

/// Checkpoints under `root` with a manifest, oldest first. A root that does not exist holds none;
/// a manifest that cannot be read is skipped (verify_all reports it).
std::vector<CheckpointEntry> list_checkpoints(const std::string& root);
/// The runs that own committed checkpoints under `root` (from their manifests alone, each read
/// bounded), sorted.
std::vector<std::string> runs_under(const std::string& root);
/// Checks every rank file of `entry` against its record (size, checksum).
VerifyReport verify_checkpoint(const CheckpointEntry& entry);
/// Every step directory under `root`, including those without a readable manifest (reported as
/// problems) and pending ones (incomplete), oldest first.
std::vector<VerifyReport> verify_all(const std::string& root);
/// Rank `rank`'s payload of `entry`, verified; throws CheckpointError naming the file.
std::string read_rank_file(const CheckpointEntry& entry, int rank);

}  // namespace checkpoint
}  // namespace stepguard
