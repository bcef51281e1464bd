/*
 * The input check: cheap evidence about the batch about to be trained on (NaN/Inf in floating
 * inputs; with a mask, empty or all-padding rows), read back to the host once for the whole
 * batch. A bad batch is a `data` cause.
 *
 * Not here: deciding anything. Thread-compatible.
 */
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace stepguard {
namespace forensics {

struct InputCheck {
  std::vector<std::string> problems;  ///< one line each; empty when the batch looks fine
  std::vector<at::Tensor> inputs;     ///< the defined inputs, detached (kept by reference)
};

/// Checks `inputs` and the optional `mask` ([batch, sequence], true = a real token). Throws
/// c10::Error, changing nothing, when the mask is not 2-D.
InputCheck check_inputs(const std::vector<at::Tensor>& inputs, const at::Tensor& mask);

}  // namespace forensics
}  // namespace stepguard
