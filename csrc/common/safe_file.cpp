#include "csrc/common/safe_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace stepguard {

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what, int error) {
  throw FileError(path + ": " + what +
                  (error != 0 ? std::string(": ") + std::strerror(error) : ""));
}

std::string not_regular(const struct stat& st) {
  if (S_ISDIR(st.st_mode)) return "a directory, not a file";
  if (S_ISFIFO(st.st_mode)) return "a FIFO, not a regular file";
  if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) return "a device, not a regular file";
  if (S_ISSOCK(st.st_mode)) return "a socket, not a regular file";
  return "not a regular file";
}

}  // namespace

int open_regular_file(const std::string& path, std::int64_t max_bytes, std::string* why) {
  // O_NONBLOCK: opening a FIFO without a writer must not hang the reader.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    *why = std::strerror(errno);
    return -1;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    *why = std::strerror(errno);
    ::close(fd);
    return -1;
  }
  if (!S_ISREG(st.st_mode)) {
    *why = not_regular(st);
    ::close(fd);
    return -1;
  }
  if (st.st_size > max_bytes) {
    *why = std::to_string(st.st_size) + " bytes, more than the " + std::to_string(max_bytes) +
           " this file can hold";
    ::close(fd);
    return -1;
  }
  // Reads block as usual from here on (a regular file never waits).
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) (void)::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

bool read_regular_file(const std::string& path, std::int64_t max_bytes, std::string* out,
                       std::string* why) {
  const int fd = open_regular_file(path, max_bytes, why);
  if (fd < 0) return false;
  struct stat st {};
  (void)::fstat(fd, &st);
  // The file may grow after the check: one byte more than its size shows that it did.
  out->resize(static_cast<std::size_t>(st.st_size) + 1);
  std::size_t done = 0;
  while (done < out->size()) {
    const ssize_t n = ::read(fd, out->data() + done, out->size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *why = std::strerror(errno);
      ::close(fd);
      return false;
    }
    if (n == 0) break;
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  if (done > static_cast<std::size_t>(st.st_size)) {
    *why = "it grew while it was read";
    return false;
  }
  out->resize(done);
  return true;
}

RegularFileLines::RegularFileLines(const std::string& path, std::int64_t max_bytes,
                                   std::size_t max_line_bytes, const std::string& what)
    : path_(path), max_line_bytes_(max_line_bytes) {
  std::string why;
  const int fd = open_regular_file(path, max_bytes, &why);
  if (fd < 0) throw FileError(path + ": cannot read " + what + ": " + why);
  file_ = ::fdopen(fd, "rb");
  if (file_ == nullptr) {
    const int error = errno;
    ::close(fd);
    fail(path, "cannot read " + what, error);
  }
}

RegularFileLines::~RegularFileLines() {
  if (file_ != nullptr) std::fclose(file_);
}

bool RegularFileLines::next(std::string* line) {
  line->clear();
  bool any = false;
  for (int c = getc_unlocked(file_); c != EOF; c = getc_unlocked(file_)) {
    any = true;
    if (c == '\n') return true;
    line->push_back(static_cast<char>(c));
    if (line->size() > max_line_bytes_) {
      throw FileError(path_ + ": a line longer than " + std::to_string(max_line_bytes_) + " bytes");
    }
  }
  if (std::ferror(file_)) fail(path_, "read error", errno);
  return any;
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail(dir, "cannot open the folder to sync it", errno);
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) fail(dir, "fsync of the folder failed", error);
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  Pieces pieces;
  pieces.add(bytes.data(), bytes.size());
  write_file_atomically(path, pieces);
}

void write_file_atomically(const std::string& path, const Pieces& pieces) {
  const std::filesystem::path target(path);
  const std::string dir = target.parent_path().empty() ? "." : target.parent_path().string();
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  // A fresh file, never through a link planted at its name: O_EXCL | O_NOFOLLOW. One left by an
  // earlier process of this pid (a crash), or planted there, is unlinked first (unlink removes a
  // link, not its target). The rename below replaces whatever sits at `path` (a link too)
  // without following it.
  constexpr int kFresh = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
  int fd = ::open(tmp.c_str(), kFresh, 0644);
  if (fd < 0 && errno == EEXIST && ::unlink(tmp.c_str()) == 0) {
    fd = ::open(tmp.c_str(), kFresh, 0644);
  }
  if (fd < 0) fail(tmp, "cannot create", errno);
  for (const auto& [data, size] : pieces.parts) {
    const char* bytes = static_cast<const char*>(data);
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = ::write(fd, bytes + done, size - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        const int error = errno;
        ::close(fd);
        ::unlink(tmp.c_str());
        fail(tmp, "write failed", error);
      }
      done += static_cast<std::size_t>(n);
    }
  }
  if (::fsync(fd) != 0) {
    const int error = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    fail(tmp, "fsync failed", error);
  }
  ::close(fd);
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    ::unlink(tmp.c_str());
    fail(path, "cannot write: it is a directory", 0);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    fail(path, "rename failed", error);
  }
  sync_directory(dir);
}

}  // namespace stepguard
