/*
 * The one way stepguard reads and writes files (C++ and, through stepguard._C, Python):
 *   reading   a regular file only (a FIFO, a device, a socket or a directory is refused, never
 *             blocked on or streamed), never more than its format allows (the size is checked
 *             before a byte is read), a symbolic link followed only to a regular file;
 *   writing   a fresh temporary file beside the target (O_EXCL | O_NOFOLLOW: never through a link
 *             planted at its name, never an existing file opened for writing), fsync, then a rename
 *             that replaces whatever sits at the target (a link too) without following it, and an
 *             fsync of the folder. No file stepguard did not create is ever truncated or written
 *             through.
 * Append-only logs (the trace) open their file with O_NOFOLLOW themselves (event_log.cpp).
 * Torch-free; standard library and POSIX only. Not for directories (the checkpoint layer owns
 * those).
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace stepguard {

/// A file could not be read or written; the message starts with the path.
class FileError : public std::runtime_error {
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

/// A descriptor of `path` open for reading when it is a regular file of at most `max_bytes`;
/// otherwise -1 with `why` saying what was wrong (strerror's text when it cannot be opened, e.g.
/// "No such file or directory"). Opening
/// never blocks (a FIFO without a writer is refused, not waited on).
int open_regular_file(const std::string& path, std::int64_t max_bytes, std::string* why);

/// Reads `path` whole into `out` when it is a regular file of at most `max_bytes`; otherwise
/// false with `why` saying what was wrong, as open_regular_file() says it.
bool read_regular_file(const std::string& path, std::int64_t max_bytes, std::string* out,
                       std::string* why);

/// Lines of a regular file, read as a stream: the file is checked as open_regular_file() does,
/// and a line longer than `max_line_bytes` is an error (a file of zeros without a newline is not
/// read into memory whole). Not thread-safe.
class RegularFileLines {
 public:
  /// Throws FileError "PATH: cannot read <what>: WHY".
  RegularFileLines(const std::string& path, std::int64_t max_bytes, std::size_t max_line_bytes,
                   const std::string& what);
  ~RegularFileLines();
  RegularFileLines(const RegularFileLines&) = delete;
  RegularFileLines& operator=(const RegularFileLines&) = delete;

  /// The next line without its '\n'; false at the end. Throws FileError on a read error or a
  /// line over the limit.
  bool next(std::string* line);

 private:
  std::string path_;
  std::size_t max_line_bytes_;
  std::FILE* file_ = nullptr;
};

/// fsync of a folder, so a rename or an unlink in it is durable. Throws FileError naming it.
void sync_directory(const std::string& dir);

/// Writes the bytes to `path` atomically, as the header says. Throws FileError naming the path.
void write_file_atomically(const std::string& path, const std::string& bytes);
void write_file_atomically(const std::string& path, const Pieces& pieces);

}  // namespace stepguard
