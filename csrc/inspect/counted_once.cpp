#include "csrc/inspect/counted_once.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>

namespace stepguard {
namespace inspect {

namespace {

// Adds one class's results (gradients `index` of the whole list) to this rank's own figures.
void merge_local(const LocalStats& part, const std::vector<std::int64_t>& index, LocalStats* out) {
  out->nan_count += part.nan_count;
  out->inf_count += part.inf_count;
  out->sum_squares += part.sum_squares;
  out->sum_squares_overflow = out->sum_squares_overflow || part.sum_squares_overflow;
  out->num_elements += part.num_elements;
  for (std::size_t j = 0; j < index.size() && j < part.tensor_sum_squares.size(); ++j) {
    out->tensor_sum_squares[static_cast<std::size_t>(index[j])] = part.tensor_sum_squares[j];
  }
  for (std::int64_t j : part.nonfinite_tensors) {
    out->nonfinite_tensors.push_back(index[static_cast<std::size_t>(j)]);
  }
}

// The per-tensor results one class left on the device, placed at their positions in the list.
void merge_deferred(const DeferredBlame& part, const std::vector<std::int64_t>& index,
                    std::int64_t count, DeferredBlame* out) {
  if (!part.pending()) return;
  const at::Device device = part.tensor_nonfinite.device();
  if (!out->pending()) {
    out->tensor_sum_squares = at::zeros({count}, part.tensor_sum_squares.options());
    out->tensor_nonfinite = at::zeros({count}, part.tensor_nonfinite.options());
  }
  const at::Tensor at_index =
      at::tensor(index, at::TensorOptions().dtype(at::kLong)).to(device, /*non_blocking=*/true);
  out->tensor_sum_squares.index_copy_(0, at_index, part.tensor_sum_squares);
  out->tensor_nonfinite.index_copy_(0, at_index, part.tensor_nonfinite);
}

}  // namespace

void inspect_counted_once(const std::vector<at::Tensor>& grads, const std::vector<int>& copies,
                          const InspectOptions& options, const at::Tensor& head, LocalStats* stats,
                          DeferredBlame* blame) {
  TORCH_CHECK(copies.size() == grads.size(), "stepguard: a layout of ", copies.size(),
              " placements for ", grads.size(), " gradients");
  // Gradients by copy count, in list order.
  std::map<int, std::vector<std::int64_t>> classes;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    TORCH_CHECK(copies[i] >= 0, "stepguard: gradient ", i, " is held by ", copies[i], " ranks");
    TORCH_CHECK(copies[i] > 0 || !grads[i].defined() || grads[i].numel() == 0,
                "stepguard: gradient ", i, " holds ", grads[i].numel(),
                " elements but its placement says it is not on this rank (absent)");
    if (copies[i] > 0) classes[copies[i]].push_back(static_cast<std::int64_t>(i));
  }
  if (classes.size() <= 1) {
    // One class (any data-parallel job): one pass over the list as it is (it checks the list
    // before it changes anything).
    inspect_into(grads, options, head, stats, blame);
    const int c = classes.empty() ? 1 : classes.begin()->first;
    if (c > 1) head.div_(static_cast<double>(c));
    return;
  }
  // Several passes: the whole list is checked before the first can unscale a gradient.
  check_gradients(grads, head);
  *stats = LocalStats();
  *blame = DeferredBlame();
  stats->num_tensors = static_cast<std::int64_t>(grads.size());
  stats->tensor_sum_squares.assign(grads.size(), 0.0);
  head.zero_();
  const at::Tensor part_head = at::zeros_like(head);
  for (const auto& [c, index] : classes) {
    std::vector<at::Tensor> part;
    part.reserve(index.size());
    for (std::int64_t i : index) part.push_back(grads[static_cast<std::size_t>(i)]);
    LocalStats part_stats;
    DeferredBlame part_blame;
    part_head.zero_();
    inspect_into(part, options, part_head, &part_stats, &part_blame);
    head.add_(part_head, 1.0 / static_cast<double>(c));  // device ops: no read to the host
    merge_local(part_stats, index, stats);
    merge_deferred(part_blame, index, stats->num_tensors, blame);
  }
  std::sort(stats->nonfinite_tensors.begin(), stats->nonfinite_tensors.end());
}

}  // namespace inspect
}  // namespace stepguard
