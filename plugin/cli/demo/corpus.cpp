#include "plugin/cli/demo/corpus.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <set>
#include <sstream>
#include <stdexcept>

#include "csrc/common/safe_file.h"

namespace stepguard {
namespace demo {

namespace {
// SplitMix64: a tiny, well-mixed counter-based generator.
std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

namespace fs = std::filesystem;

// Every regular file under `dir` (links followed, each file once), in name order.
std::vector<fs::path> every_file(const std::string& dir) {
  std::error_code ec;
  std::vector<fs::path> files;
  std::set<fs::path> seen;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const fs::path real = fs::canonical(entry.path(), ec);
    if (ec || !fs::is_regular_file(real, ec) || !seen.insert(real).second) continue;
    files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

const std::vector<std::string>& stable_license_texts() {
  static const std::vector<std::string> names = {"Apache-2.0", "BSD",    "CC0-1.0", "GFDL-1.3",
                                                 "GPL-3",      "LGPL-3", "MPL-1.1", "MPL-2.0"};
  return names;
}

Corpus Corpus::load(const std::string& dir, const std::vector<std::string>& names) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw std::runtime_error("demo: corpus directory '" + dir + "' does not exist");
  }
  std::vector<fs::path> files;
  if (names.empty()) {
    files = every_file(dir);
  } else {
    for (const auto& name : names) {
      files.push_back(fs::path(dir) / name);
      if (!fs::is_regular_file(files.back(), ec)) {
        throw std::runtime_error("demo: corpus file '" + files.back().string() +
                                 "' does not exist (the demo's default texts; --corpus DIR reads "
                                 "every file of a directory of your own)");
      }
    }
  }
  std::string text;
  Corpus corpus;
  for (const auto& path : files) {
    // A text of the corpus is a book at most; anything else under the folder is left out.
    constexpr std::int64_t kMaxTextBytes = std::int64_t{64} << 20;
    std::string content, why;
    if (!read_regular_file(path.string(), kMaxTextBytes, &content, &why)) continue;
    text += content;
    text += '\n';
    ++corpus.num_files_;
  }
  if (text.size() < 4096) {
    throw std::runtime_error("demo: corpus directory '" + dir + "' holds too little text (" +
                             std::to_string(text.size()) + " bytes)");
  }
  std::array<bool, 256> present{};
  for (unsigned char c : text) present[c] = true;
  std::array<std::int64_t, 256> id{};
  for (int c = 0; c < 256; ++c) {
    if (present[c]) {
      id[c] = static_cast<std::int64_t>(corpus.alphabet_.size());
      corpus.alphabet_.push_back(static_cast<char>(c));
    }
  }
  corpus.tokens_.reserve(text.size());
  for (unsigned char c : text) corpus.tokens_.push_back(id[c]);
  return corpus;
}

std::vector<std::int64_t> Corpus::batch_offsets(std::uint64_t seed, std::int64_t batch_index,
                                                std::int64_t batch_size,
                                                std::int64_t context) const {
  const std::uint64_t span = static_cast<std::uint64_t>(size() - context - 1);
  std::vector<std::int64_t> offsets(batch_size);
  for (std::int64_t row = 0; row < batch_size; ++row) {
    const std::uint64_t key =
        splitmix64(seed ^ splitmix64(static_cast<std::uint64_t>(batch_index)) ^
                   (static_cast<std::uint64_t>(row) << 40));
    offsets[row] = static_cast<std::int64_t>(key % span);
  }
  return offsets;
}

}  // namespace demo
}  // namespace stepguard
