#include "csrc/inspect/inspect.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace stepguard {
namespace inspect {

GradDtype grad_dtype_of(const at::Tensor& grad, std::size_t index) {
  switch (grad.scalar_type()) {
    case at::kFloat:
      return GradDtype::kFloat32;
    case at::kHalf:
      return GradDtype::kFloat16;
    case at::kBFloat16:
      return GradDtype::kBFloat16;
    case at::kDouble:
      return GradDtype::kFloat64;
    default:
      TORCH_CHECK(false, "stepguard: gradient ", index, " has dtype ", grad.scalar_type(),
                  "; inspection supports float32, float16, bfloat16 and float64");
  }
  return GradDtype::kFloat32;  // unreachable
}

namespace {

// One unit of work: a fixed-size slice of one gradient.
struct Chunk {
  std::size_t tensor;
  std::int64_t begin;
  std::int64_t end;
};

}  // namespace

LocalStats inspect_gradients(const std::vector<at::Tensor>& grads, const InspectOptions& options) {
  TORCH_CHECK(std::isfinite(options.inv_scale) && options.inv_scale > 0.0,
              "stepguard: inv_scale must be finite and positive, got ", options.inv_scale);
  LocalStats stats;
  stats.num_tensors = static_cast<std::int64_t>(grads.size());
  stats.tensor_sum_squares.assign(grads.size(), 0.0);

  // Validate everything before touching anything, so a bad list changes no gradient.
  const at::Tensor* first = nullptr;
  std::size_t first_index = 0;
  std::vector<at::Tensor> views(grads.size());
  std::vector<GradDtype> dtypes(grads.size(), GradDtype::kFloat32);
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (!g.defined()) continue;
    TORCH_CHECK(g.layout() == at::kStrided, "stepguard: gradient ", i,
                " is sparse; inspection supports dense gradients only");
    if (first == nullptr) {
      first = &g;
      first_index = i;
    } else {
      TORCH_CHECK(g.device() == first->device(), "stepguard: gradient ", i, " is on ", g.device(),
                  " but gradient ", first_index, " is on ", first->device(),
                  "; all gradients of one guard must be on one device");
    }
    TORCH_CHECK(g.device().is_cpu(), "stepguard: gradient ", i, " is on ", g.device(),
                "; this build inspects CPU gradients only");
    dtypes[i] = grad_dtype_of(g, i);
    views[i] = g.is_contiguous() ? g : g.contiguous();
  }

  std::vector<Chunk> chunks;
  for (std::size_t i = 0; i < views.size(); ++i) {
    if (!views[i].defined()) continue;
    const std::int64_t n = views[i].numel();
    stats.num_elements += n;
    for (std::int64_t b = 0; b < n; b += kChunkElements) {
      chunks.push_back({i, b, std::min(n, b + kChunkElements)});
    }
  }

  const bool unscale_here = options.unscale_in_place && options.inv_scale != 1.0;
  std::vector<ChunkStats> partial(chunks.size());
  at::parallel_for(0, static_cast<std::int64_t>(chunks.size()), 1,
                   [&](std::int64_t lo, std::int64_t hi) {
                     for (std::int64_t c = lo; c < hi; ++c) {
                       const Chunk& ch = chunks[c];
                       const GradDtype dt = dtypes[ch.tensor];
                       const bool wide = dt == GradDtype::kFloat32 || dt == GradDtype::kFloat64;
                       partial[c] = inspect_range(views[ch.tensor].data_ptr(), dt, ch.begin, ch.end,
                                                  options.inv_scale, unscale_here && wide);
                     }
                   });

  // Fixed order: chunks within a tensor, then tensors in parameter order.
  std::vector<std::int64_t> tensor_nonfinite(grads.size(), 0);
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    const ChunkStats& p = partial[c];
    stats.tensor_sum_squares[chunks[c].tensor] += p.sum_squares;
    tensor_nonfinite[chunks[c].tensor] += p.nan_count + p.inf_count;
    stats.nan_count += p.nan_count;
    stats.inf_count += p.inf_count;
  }
  for (std::size_t i = 0; i < grads.size(); ++i) {
    stats.sum_squares += stats.tensor_sum_squares[i];
    if (tensor_nonfinite[i] > 0) stats.nonfinite_tensors.push_back(static_cast<std::int64_t>(i));
  }
  stats.sum_squares_overflow = !std::isfinite(stats.sum_squares);

  if (unscale_here) {
    for (std::size_t i = 0; i < grads.size(); ++i) {
      if (!views[i].defined()) continue;
      const bool wide = dtypes[i] == GradDtype::kFloat32 || dtypes[i] == GradDtype::kFloat64;
      if (!wide) {
        views[i].mul_(options.inv_scale);
      }
      if (!views[i].is_same(grads[i])) {
        grads[i].copy_(views[i]);
      }
    }
  }
  return stats;
}

}  // namespace inspect
}  // namespace stepguard
