#include "csrc/checkpoint/named_tensors.h"

#include <ATen/core/grad_mode.h>
#include <sstream>

#include "csrc/checkpoint/disk_checkpoint.h"

namespace stepguard {
namespace checkpoint {

namespace {
std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "missing";
  std::ostringstream out;
  out << t.scalar_type() << t.sizes();
  return out.str();
}
}  // namespace

std::int64_t bytes_of(const std::vector<NamedTensor>& tensors) {
  std::int64_t total = 0;
  for (const auto& t : tensors) {
    if (t.tensor.defined()) total += static_cast<std::int64_t>(t.tensor.nbytes());
  }
  return total;
}

void check_fits(const std::vector<NamedTensor>& saved, const std::vector<NamedTensor>& live,
                const std::string& source) {
  for (std::size_t i = 0; i < saved.size() && i < live.size(); ++i) {
    const NamedTensor& s = saved[i];
    const NamedTensor& l = live[i];
    if (s.name != l.name) {
      throw CheckpointError(source + ": holds '" + s.name + "' where the model has '" + l.name +
                            "'");
    }
    const bool same = s.tensor.defined() == l.tensor.defined() &&
                      (!s.tensor.defined() || (s.tensor.sizes() == l.tensor.sizes() &&
                                               s.tensor.scalar_type() == l.tensor.scalar_type()));
    if (!same) {
      throw CheckpointError(source + ": '" + s.name + "' is " + describe(s.tensor) +
                            " in the checkpoint, " + describe(l.tensor) + " in the model");
    }
  }
  if (saved.size() != live.size()) {
    const bool more = saved.size() > live.size();
    throw CheckpointError(source + ": holds " + std::to_string(saved.size()) +
                          " tensors, the model has " + std::to_string(live.size()) + " ('" +
                          (more ? saved[live.size()].name : live[saved.size()].name) +
                          (more ? "' is extra)" : "' is missing)"));
  }
}

void copy_into(const std::vector<NamedTensor>& saved, const std::vector<NamedTensor>& live) {
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < saved.size() && i < live.size(); ++i) {
    if (saved[i].tensor.defined()) live[i].tensor.detach().copy_(saved[i].tensor);
  }
}

}  // namespace checkpoint
}  // namespace stepguard
