/*
 * The demo's training text: the license texts every Debian system ships, read once and turned
 * into character tokens. Batches are a pure function of (seed, batch index), so the data position
 * is one counter and a skipped or replayed batch is exactly reproducible.
 */
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace stepguard {
namespace demo {

/// The demo's default texts in /usr/share/common-licenses: the ones Debian 12 and Debian 13 ship
/// byte for byte alike (other files there differ between the releases or exist in one only), so
/// the demo trains on the same data, and follows the same trajectory, on both.
const std::vector<std::string>& stable_license_texts();

/// A character-level corpus. Immutable after load; safe to share between threads.
class Corpus {
 public:
  /// Reads the files `names` of `dir`, in that order, or every regular file under `dir` (links
  /// followed, each file once) in name order when `names` is empty. Throws std::runtime_error
  /// naming the directory or the file when it cannot be read.
  static Corpus load(const std::string& dir, const std::vector<std::string>& names = {});

  std::int64_t vocab_size() const noexcept { return static_cast<std::int64_t>(alphabet_.size()); }
  std::int64_t size() const noexcept { return static_cast<std::int64_t>(tokens_.size()); }
  std::size_t num_files() const noexcept { return num_files_; }
  const std::vector<std::int64_t>& tokens() const noexcept { return tokens_; }

  /// Start offsets of the `batch_size` windows of batch `batch_index`, each leaving room for
  /// context + 1 tokens.
  std::vector<std::int64_t> batch_offsets(std::uint64_t seed, std::int64_t batch_index,
                                          std::int64_t batch_size, std::int64_t context) const;

 private:
  std::vector<std::int64_t> tokens_;
  std::string alphabet_;
  std::size_t num_files_ = 0;
};

}  // namespace demo
}  // namespace stepguard
