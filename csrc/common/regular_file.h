/*
 * Reading a file the user or another process may have put anything in place of: a regular file
 * only (a FIFO, a device or a directory is refused, never blocked on or streamed), and never more
 * than its format allows (the size is checked before a byte is read). Header-only, standard
 * library and POSIX only.
 */
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

namespace stepguard {

/// Reads `path` whole into `out` when it is a regular file of at most `max_bytes`; otherwise
/// false with `why` saying what was wrong ("missing" when it does not exist).
inline bool read_regular_file(const std::string& path, std::int64_t max_bytes, std::string* out,
                              std::string* why) {
  // O_NONBLOCK: opening a FIFO without a writer must not hang the reader.
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
  if (st.st_size > max_bytes) {
    *why = std::to_string(st.st_size) + " bytes, more than the " + std::to_string(max_bytes) +
           " this file can hold";
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

}  // namespace stepguard
