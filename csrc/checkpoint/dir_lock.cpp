#include "csrc/checkpoint/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "csrc/checkpoint/disk_checkpoint.h"
#include "csrc/common/safe_file.h"

namespace stepguard {
namespace checkpoint {

namespace fs = std::filesystem;

int lock_checkpoint_dir(const std::string& root, std::string* holder) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) throw CheckpointError(root + ": cannot create the checkpoint directory: " + ec.message());
  const std::string path = root + "/.stepguard-lock";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    throw CheckpointError(path + ": cannot open the lock file: " + std::strerror(errno));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    std::string pid, why;
    ::close(fd);
    if (error != EWOULDBLOCK)
      throw CheckpointError(path + ": cannot lock: " + std::strerror(error));
    read_regular_file(path, 64, &pid, &why);
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    *holder = "process " + (pid.empty() ? std::string("?") : pid) + " holds " + path;
    return -1;
  }
  const std::string me = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) < 0) {
    // The id is only for messages: the lock holds without it.
  }
  return fd;
}

}  // namespace checkpoint
}  // namespace stepguard
