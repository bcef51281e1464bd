#include "plugin/src/moment_reset.h"

#include <ATen/ops/_foreach_zero.h>

#include <algorithm>
#include <cstddef>
#include <optional>

namespace stepguard {
namespace {

bool named(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

std::optional<std::size_t> state_index(const std::string& name) {
  const std::size_t dot = name.find('.');
  if (dot == std::string::npos || dot == 0 || dot > 9) return std::nullopt;
  std::size_t index = 0;
  for (std::size_t i = 0; i < dot; ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    index = index * 10 + static_cast<std::size_t>(name[i] - '0');
  }
  return index;
}

std::string state_key(const std::string& name) {
  const std::size_t dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

bool resettable_moment(const std::string& name) {
  static const char* const kMoments[] = {"exp_avg",         "exp_avg_sq", "max_exp_avg_sq",
                                         "momentum_buffer", "square_avg", "grad_avg",
                                         "acc_delta",       "exp_inf"};
  const std::string key = state_key(name);
  return std::any_of(std::begin(kMoments), std::end(kMoments),
                     [&](const char* k) { return key == k; });
}

std::int64_t reset_moments(OptimizerPort& port, const std::vector<std::string>& affected) {
  std::vector<at::Tensor> moments;
  std::vector<std::string> owners;
  bool any_owner_named = false;
  for (const NamedTensor& t : port.state_tensors()) {
    if (!t.tensor.defined() || !t.tensor.is_floating_point() || !resettable_moment(t.name)) {
      continue;
    }
    const std::optional<std::size_t> index = state_index(t.name);
    owners.push_back(index ? port.state_owner(*index) : std::string());
    any_owner_named = any_owner_named || named(affected, owners.back());
    moments.push_back(t.tensor);
  }
  std::vector<at::Tensor> zeroed;
  for (std::size_t i = 0; i < moments.size(); ++i) {
    if (!any_owner_named || named(affected, owners[i])) zeroed.push_back(moments[i]);
  }
  if (!zeroed.empty()) at::_foreach_zero_(zeroed);
  return static_cast<std::int64_t>(zeroed.size());
}

}  // namespace stepguard
