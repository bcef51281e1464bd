/*
 * Named tensors: what RAM snapshots and disk checkpoints hold (parameters, module buffers, the
 * optimizer's state tensors, each under a stable name), and the one check-then-copy that puts a
 * saved set back into the live tensors in place.
 *
 * Not here: where the names come from (the optimizer port and the engine name them). Thread-
 * compatible.
 */
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace stepguard {
namespace checkpoint {

struct NamedTensor {
  std::string name;
  at::Tensor tensor;  ///< may be undefined (a state field an optimizer does not use)
};

/// Host bytes of the defined tensors.
std::int64_t bytes_of(const std::vector<NamedTensor>& tensors);

/// Throws CheckpointError naming `source` and the first tensor that differs unless `saved` and
/// `live` hold the same names in the same order with the same dtypes and shapes (undefined
/// matching undefined). Changes nothing.
void check_fits(const std::vector<NamedTensor>& saved, const std::vector<NamedTensor>& live,
                const std::string& source);
/// The optimizer's saved state tensors, as every port names them: "<parameter index>.<key>" with
/// an index below `parameters`, each name once, no quantized dtype, and the dtype and shape of the
/// live tensor of the same name where the optimizer already holds one (`live`: its state tensors
/// now; empty before its first step). Throws CheckpointError naming `source` and the tensor;
/// changes nothing. The ports check what only they can read (their opaque bytes) themselves.
void check_optimizer_tensors(const std::vector<NamedTensor>& saved,
                             const std::vector<NamedTensor>& live, std::size_t parameters,
                             const std::string& source);
/// Copies every saved tensor into its live twin in place (across devices as needed). Call
/// check_fits() first.
void copy_into(const std::vector<NamedTensor>& saved, const std::vector<NamedTensor>& live);

}  // namespace checkpoint
}  // namespace stepguard
