/*
 * The input check: cheap evidence about the batch about to be trained on (NaN/Inf in floating
 * inputs; with a mask, empty or all-padding rows). The counts stay where the inputs live: the
 * step engine adds "this rank's batch is bad" to its one collective, and the counts are read to
 * the host only when someone asks what the problems are (an incident, or a caller that wants the
 * answer now). A bad batch is a `data` cause.
 *
 * Not here: deciding anything. Thread-compatible; problems() caches its one read.
 */
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace stepguard {
namespace forensics {

class InputCheck {
 public:
  /// The defined inputs, detached (kept by reference; copied to the host only for a report).
  std::vector<at::Tensor> inputs;

  /// A 0-d bool tensor on the inputs' device, true when any count is nonzero; undefined when
  /// nothing was counted (see known_bad() for what the host already knows). No read.
  const at::Tensor& any_counted() const noexcept { return any_; }
  /// What is known without reading the device: the sequences have length 0.
  bool known_bad() const noexcept { return zero_length_; }
  /// One line per problem; empty when the batch looks fine. The first call reads the counts to
  /// the host (one read for the whole batch).
  const std::vector<std::string>& problems() const;

 private:
  friend InputCheck check_inputs(const std::vector<at::Tensor>& inputs, const at::Tensor& mask);
  at::Tensor counts_;  ///< kLong: per counted input its NaN then its Inf count, then the empty rows
  at::Tensor any_;
  std::vector<std::size_t> counted_;  ///< input index of each count
  bool has_mask_ = false;
  std::int64_t mask_rows_ = 0;
  bool zero_length_ = false;
  mutable std::optional<std::vector<std::string>> problems_;
};

/// Checks `inputs` and the optional `mask` ([batch, sequence], true = a real token) with device
/// ops only. Throws c10::Error, changing nothing, when the mask is not 2-D.
InputCheck check_inputs(const std::vector<at::Tensor>& inputs, const at::Tensor& mask);

}  // namespace forensics
}  // namespace stepguard
