/*
 * Private to the disk checkpoint code: what disk_checkpoint.cpp (writing, committing, pruning)
 * and disk_checkpoint_read.cpp (listing, verifying, reading) share: the names inside a checkpoint
 * directory and the manifest reader. Not installed and not an API; everything else includes
 * disk_checkpoint.h. Torch-free.
 */
#pragma once

#include <cstdint>
#include <string>

#include "csrc/checkpoint/disk_checkpoint.h"

namespace stepguard {
namespace checkpoint {
namespace detail {

/// A step directory's manifest, written last by the commit.
constexpr const char* kManifest = "MANIFEST.json";
/// Between a step directory's name and the run in a pending directory's name.
constexpr const char* kPendingTag = ".pending.";
/// The start of the name of a directory renamed out of sight to be deleted.
constexpr const char* kTrashPrefix = ".trash.";

/// Manifests and rank records are a few hundred bytes; nothing but a rank's payload is larger
/// than this, and a payload's size is in its record.
constexpr std::int64_t kMaxSmallFile = std::int64_t{1} << 20;

/// "rank-NNNNN.<ext>", the name of a rank's file (ckpt) or record (json).
std::string rank_name(int rank, const char* ext);

/// Parses "step-NNNNNNNNN"; -1 when the name is not a step directory.
std::int64_t step_of_dir_name(const std::string& name);

/// Parses "step-NNNNNNNNN.pending.RUN"; false when the name is not a pending directory.
bool parse_pending_name(const std::string& name, std::int64_t* step, std::string* run);

/// Reads the manifest of `dir` (disk_checkpoint_read.cpp); returns false with `problem` set when
/// it is missing or unreadable.
bool read_manifest(const std::string& dir, CheckpointEntry* entry, std::string* problem);

}  // namespace detail
}  // namespace checkpoint
}  // namespace stepguard
