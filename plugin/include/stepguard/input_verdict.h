/*
 * InputVerdict: what GuardedOptimizer::check_inputs() found in a step's batch.
 */
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stepguard {

/// What check_inputs() found. The counts stay on the inputs' device and reach the step's one
/// collective; they are read to the host only when asked: by converting to bool or by problems()
/// (one read, cached). A loop that ignores the verdict costs no read.
class InputVerdict {
 public:
  explicit InputVerdict(std::function<std::vector<std::string>()> read) : read_(std::move(read)) {}
  /// One line per problem; empty when the batch looks fine.
  const std::vector<std::string>& problems() const {
    if (!problems_) problems_ = read_ ? read_() : std::vector<std::string>();
    return *problems_;
  }
  /// True when the batch looks fine.
  bool clean() const { return problems().empty(); }
  explicit operator bool() const { return clean(); }

 private:
  std::function<std::vector<std::string>()> read_;
  mutable std::optional<std::vector<std::string>> problems_;
};

}  // namespace stepguard
