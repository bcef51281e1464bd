/*
 * Who owns a checkpoint directory: the run whose rank 0 holds its lock file. The lock lives as
 * long as its process; nothing here reads or writes checkpoints (disk_checkpoint.h does).
 * Torch-free, POSIX.
 */
#pragma once

#include <string>

namespace stepguard {
namespace checkpoint {

/// Takes `root` for this run while it lives: an exclusive lock (flock) on `root/.stepguard-lock`
/// (created with `root` when missing), holding this process's id for the messages of others. One
/// rank of a run takes it (rank 0); a second run started on the same directory is refused at once,
/// before either has written, instead of discovering the other's checkpoints later. The lock goes
/// with its process (a dead run leaves no stale lock). Returns the descriptor to keep open (close
/// it to release), or -1 with `holder` saying who holds it; throws CheckpointError when the
/// directory cannot be made or the file opened.
int lock_checkpoint_dir(const std::string& root, std::string* holder);

}  // namespace checkpoint
}  // namespace stepguard
