#include "csrc/checkpoint/named_tensors.h"

#include <ATen/core/grad_mode.h>
#include <map>
#include <set>
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

void check_optimizer_tensors(const std::vector<NamedTensor>& saved,
                             const std::vector<NamedTensor>& live, std::size_t parameters,
                             const std::string& source) {
  std::map<std::string, const at::Tensor*> holds;
  for (const auto& t : live) holds[t.name] = &t.tensor;
  std::set<std::string> seen;
  for (const auto& t : saved) {
    const std::string where = source + ": optimizer state tensor '" + t.name + "'";
    const std::size_t dot = t.name.find('.');
    std::size_t index = 0;
    bool numbered = dot != std::string::npos && dot > 0 && dot < 19 && dot + 1 < t.name.size();
    for (std::size_t i = 0; numbered && i < dot; ++i) {
      numbered = t.name[i] >= '0' && t.name[i] <= '9';
      index = index * 10 + static_cast<std::size_t>(t.name[i] - '0');
    }
    if (!numbered) throw CheckpointError(where + " is not named <parameter index>.<key>");
    if (index >= parameters) {
      throw CheckpointError(where + " belongs to parameter " + std::to_string(index) +
                            "; the optimizer has " + std::to_string(parameters));
    }
    if (!seen.insert(t.name).second) throw CheckpointError(where + " is saved twice");
    if (!t.tensor.defined()) continue;
    if (t.tensor.is_quantized()) {
      throw CheckpointError(where + " has the quantized dtype " +
                            std::string(c10::toString(t.tensor.scalar_type())));
    }
    const auto it = holds.find(t.name);
    if (it == holds.end() || !it->second->defined()) continue;
    const at::Tensor& now = *it->second;
    if (now.sizes() != t.tensor.sizes() || now.scalar_type() != t.tensor.scalar_type()) {
      throw CheckpointError(where + " is " + describe(t.tensor) + " in the checkpoint, " +
                            describe(now) + " in the optimizer");
    }
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
