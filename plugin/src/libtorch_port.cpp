#include "plugin/src/libtorch_port.h"

#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "plugin/src/libtorch_optimizer_state.h"

namespace stepguard {

namespace {

using Json = nlohmann::json;
using libtorch_port::StateFields;

// Opaque bytes start with their kind: typed states (JSON follows) or a whole archive.
constexpr char kTyped = 'T';
constexpr char kArchive = 'A';

// torch 2.x keys a C++ optimizer's state by the parameter's TensorImpl address.
void* state_key(const at::Tensor& p) { return p.unsafeGetTensorImpl(); }

// The live tensor when it can be refilled in place, else a new one shaped as saved.
at::Tensor reuse_or_allocate(const at::Tensor& live, const at::Tensor& saved,
                             const at::Device& device) {
  if (live.defined() && live.sizes() == saved.sizes() &&
      live.scalar_type() == saved.scalar_type() && live.device() == device) {
    return live;
  }
  return at::empty(saved.sizes(), at::TensorOptions().dtype(saved.scalar_type()).device(device));
}

}  // namespace

LibTorchPort::LibTorchPort(torch::optim::Optimizer& optimizer,
                           const torch::OrderedDict<std::string, torch::Tensor>& named_parameters,
                           std::vector<Placement> layout)
    : optimizer_(optimizer), named_(named_parameters), layout_(std::move(layout)) {
  collect(named_);
}

void LibTorchPort::collect(const torch::OrderedDict<std::string, torch::Tensor>& named) {
  std::unordered_map<const c10::TensorImpl*, std::string> name_of;
  for (const auto& item : named) name_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
  params_.clear();
  names_.clear();
  for (const auto& group : optimizer_.param_groups()) {
    for (const auto& p : group.params()) {
      auto it = name_of.find(p.unsafeGetTensorImpl());
      names_.push_back(it != name_of.end() ? it->second
                                           : "param_" + std::to_string(params_.size()));
      params_.push_back(p);
    }
  }
}

void LibTorchPort::refresh() {
  // By identity: a group added, or other tensors put into a group, is another list.
  std::size_t n = 0;
  bool same = true;
  for (const auto& group : optimizer_.param_groups()) {
    for (const auto& p : group.params()) {
      same =
          same && n < params_.size() && params_[n].unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
      ++n;
    }
  }
  if (!same || n != params_.size()) collect(named_);
}

double LibTorchPort::largest_lr() const {
  double out = std::numeric_limits<double>::quiet_NaN();
  for (const auto& group : optimizer_.param_groups()) {
    const double lr = group.options().get_lr();
    out = std::isnan(out) ? lr : std::max(out, lr);
  }
  return out;
}

void LibTorchPort::apply(double lr_factor) {
  if (lr_factor == 1.0) {
    optimizer_.step();
    return;
  }
  std::vector<double> saved;
  for (auto& group : optimizer_.param_groups()) {
    saved.push_back(group.options().get_lr());
    group.options().set_lr(saved.back() * lr_factor);
  }
  auto restore = [&] {
    std::size_t i = 0;
    for (auto& group : optimizer_.param_groups()) group.options().set_lr(saved[i++]);
  };
  try {
    optimizer_.step();
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

bool LibTorchPort::typed() const {
  for (const auto& [key, state] : optimizer_.state()) {
    std::string type;
    std::int64_t step = 0;
    StateFields fields;
    if (!libtorch_port::read_fields(*state, &type, &step, &fields)) return false;
  }
  return true;
}

template <typename Visit>
void LibTorchPort::each_state(Visit visit) const {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto it = optimizer_.state().find(state_key(params_[i]));
    if (it == optimizer_.state().end()) continue;
    std::string type;
    std::int64_t step = 0;
    StateFields fields;
    libtorch_port::read_fields(*it->second, &type, &step, &fields);
    visit(i, type, step, fields);
  }
}

std::vector<NamedTensor> LibTorchPort::state_tensors() const {
  std::vector<NamedTensor> out;
  if (!typed()) return out;  // the archive in state_bytes() holds everything
  each_state([&](std::size_t i, const std::string&, std::int64_t, const StateFields& fields) {
    for (const auto& [name, t] : fields) {
      if (t.defined()) out.push_back({std::to_string(i) + "." + name, t});
    }
  });
  return out;
}

std::string LibTorchPort::state_bytes() const {
  if (!typed()) {
    torch::serialize::OutputArchive archive;
    optimizer_.save(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    return kArchive + bytes.str();
  }
  Json states = Json::array();
  each_state(
      [&](std::size_t i, const std::string& type, std::int64_t step, const StateFields& fields) {
        Json defined = Json::array();
        for (const auto& [name, t] : fields) {
          if (t.defined()) defined.push_back(name);
        }
        states.push_back({{"param", i}, {"type", type}, {"step", step}, {"fields", defined}});
      });
  // Each group's lr, as the optimizer's own archive keeps its options (a resume puts it back).
  Json lrs = Json::array();
  for (const auto& group : optimizer_.param_groups()) lrs.push_back(group.options().get_lr());
  return kTyped + Json{{"states", states}, {"lr", lrs}}.dump();
}

void LibTorchPort::check_state_bytes(const std::string& bytes,
                                     const std::vector<NamedTensor>& saved) const {
  if (bytes.empty()) {
    TORCH_CHECK(saved.empty(), "stepguard: the saved optimizer state has tensors but no structure");
    return;
  }
  TORCH_CHECK(!bytes.empty() && (bytes[0] == kTyped || bytes[0] == kArchive),
              "stepguard: the saved optimizer state is not a LibTorch optimizer's");
  if (bytes[0] == kTyped) (void)read_typed(bytes.substr(1), saved);
}

void LibTorchPort::load_state_bytes(const std::string& bytes, const std::vector<NamedTensor>& saved,
                                    bool settings) {
  check_state_bytes(bytes, saved);
  if (bytes.empty()) {
    optimizer_.state().clear();
    return;
  }
  if (bytes[0] == kTyped) {
    const TypedState typed = read_typed(bytes.substr(1), saved);
    load_typed(typed.entries, saved);
    if (settings) {
      std::size_t g = 0;
      for (auto& group : optimizer_.param_groups()) group.options().set_lr(typed.lrs.at(g++));
    }
    return;
  }
  // The archive holds the groups' options too: a rollback keeps the live ones.
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> live;
  if (!settings) {
    for (const auto& group : optimizer_.param_groups()) live.push_back(group.options().clone());
  }
  try {
    torch::serialize::InputArchive archive;
    std::istringstream in(bytes.substr(1));
    archive.load_from(in);
    optimizer_.load(archive);
    std::size_t g = 0;
    for (auto& group : optimizer_.param_groups()) {
      if (g < live.size()) group.set_options(std::move(live[g++]));
    }
  } catch (const std::exception& e) {
    std::string what = e.what();
    if (const auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
    TORCH_CHECK(false, "stepguard: the saved optimizer state does not fit this optimizer (", what,
                ")");
  }
}

LibTorchPort::TypedState LibTorchPort::read_typed(const std::string& json,
                                                  const std::vector<NamedTensor>& saved) const {
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& t : saved) by_name[t.name] = &t.tensor;
  TypedState typed;
  std::vector<TypedEntry>& entries = typed.entries;
  bool recorded = false;  // the groups' lr
  try {
    // {"states": [...], "lr": [...]}; before the fifth trust round the states array alone.
    const Json doc = Json::parse(json);
    const Json& states = doc.is_array() ? doc : doc.at("states");
    for (const Json& s : states) {
      entries.push_back({s.at("param").get<std::size_t>(), s.at("type").get<std::string>(),
                         s.at("step").get<std::int64_t>(),
                         s.at("fields").get<std::vector<std::string>>()});
    }
    recorded = doc.is_object();
    if (recorded) typed.lrs = doc.at("lr").get<std::vector<double>>();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "stepguard: the saved optimizer state is unreadable (", e.what(), ")");
  }
  const std::size_t groups = optimizer_.param_groups().size();
  if (recorded) {
    TORCH_CHECK(typed.lrs.size() == groups, "stepguard: the saved optimizer state has ",
                typed.lrs.size(), " param groups; this optimizer has ", groups);
  } else {
    for (const auto& g : optimizer_.param_groups()) typed.lrs.push_back(g.options().get_lr());
  }
  for (std::size_t g = 0; g < typed.lrs.size(); ++g) {
    TORCH_CHECK(std::isfinite(typed.lrs[g]) && typed.lrs[g] >= 0.0,
                "stepguard: the saved lr of param group ", g, " is ", typed.lrs[g],
                ", not a finite number >= 0");
  }
  for (const TypedEntry& e : entries) {
    TORCH_CHECK(e.param < params_.size(), "stepguard: the saved optimizer state names parameter ",
                e.param, "; the optimizer has ", params_.size());
    TORCH_CHECK(libtorch_port::optimizer_is(optimizer_, e.type), "stepguard: the saved state is ",
                e.type, " optimizer state, which this optimizer does not keep");
    for (const auto& f : e.fields) {
      auto it = by_name.find(std::to_string(e.param) + "." + f);
      TORCH_CHECK(it != by_name.end() && it->second->defined(),
                  "stepguard: the saved optimizer state lacks tensor '", e.param, ".", f, "'");
      TORCH_CHECK(it->second->sizes() == params_[e.param].sizes(),
                  "stepguard: saved optimizer state '", e.param, ".", f, "' has shape ",
                  it->second->sizes(), " but parameter '", names_[e.param], "' has shape ",
                  params_[e.param].sizes());
    }
  }
  return typed;
}

void LibTorchPort::load_typed(const std::vector<TypedEntry>& entries,
                              const std::vector<NamedTensor>& saved) {
  std::map<std::string, at::Tensor> by_name;
  for (const auto& t : saved) by_name[t.name] = t.tensor;
  auto& live = optimizer_.state();
  std::remove_reference_t<decltype(optimizer_.state())> rebuilt;
  for (const TypedEntry& e : entries) {
    const at::Tensor& p = params_[e.param];
    void* const key = state_key(p);
    std::string live_type;
    std::int64_t live_step = 0;
    StateFields live_fields;
    auto it = live.find(key);
    const bool same =
        it != live.end() &&
        libtorch_port::read_fields(*it->second, &live_type, &live_step, &live_fields) &&
        live_type == e.type;
    std::map<std::string, at::Tensor> fields;
    for (const auto& f : e.fields) {
      at::Tensor old;
      for (const auto& [name, t] : live_fields) {
        if (same && name == f) old = t;
      }
      fields[f] = reuse_or_allocate(old, by_name[std::to_string(e.param) + "." + f], p.device());
    }
    rebuilt[key] = libtorch_port::make_state(e.type, e.step, fields);
  }
  live = std::move(rebuilt);
}

}  // namespace stepguard
