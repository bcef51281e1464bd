#include "csrc/checkpoint/snapshot.h"

#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <mutex>
#include <sstream>
#include <unordered_map>

namespace stepguard {
namespace checkpoint {

namespace {

// A host copy that shares nothing with `t`; undefined stays undefined.
at::Tensor host_copy(const at::Tensor& t, std::int64_t* bytes) {
  if (!t.defined()) return t;
  at::Tensor copy = t.device().is_cpu() ? t.detach().clone() : t.detach().to(at::kCPU);
  *bytes += static_cast<std::int64_t>(copy.numel() * copy.element_size());
  return copy;
}

// A copy on `device` that shares nothing with the snapshot (a snapshot outlives a rollback).
at::Tensor device_copy(const at::Tensor& t, const at::Device& device) {
  if (!t.defined()) return t;
  return t.to(device, /*non_blocking=*/false, /*copy=*/true);
}

// Deep copy of one optimizer's per-parameter state, moving tensors with `copy`. Returns nullptr
// for a state type without a typed copy.
template <typename Copy>
std::unique_ptr<torch::optim::OptimizerParamState> copy_state(
    const torch::optim::OptimizerParamState& s, Copy copy) {
  using namespace torch::optim;
  if (auto* a = dynamic_cast<const AdamWParamState*>(&s)) {
    auto c = std::make_unique<AdamWParamState>(*a);
    c->exp_avg(copy(a->exp_avg())).exp_avg_sq(copy(a->exp_avg_sq()));
    c->max_exp_avg_sq(copy(a->max_exp_avg_sq()));
    return c;
  }
  if (auto* a = dynamic_cast<const AdamParamState*>(&s)) {
    auto c = std::make_unique<AdamParamState>(*a);
    c->exp_avg(copy(a->exp_avg())).exp_avg_sq(copy(a->exp_avg_sq()));
    c->max_exp_avg_sq(copy(a->max_exp_avg_sq()));
    return c;
  }
  if (auto* g = dynamic_cast<const SGDParamState*>(&s)) {
    auto c = std::make_unique<SGDParamState>(*g);
    c->momentum_buffer(copy(g->momentum_buffer()));
    return c;
  }
  if (auto* g = dynamic_cast<const AdagradParamState*>(&s)) {
    auto c = std::make_unique<AdagradParamState>(*g);
    c->sum(copy(g->sum()));
    return c;
  }
  if (auto* r = dynamic_cast<const RMSpropParamState*>(&s)) {
    auto c = std::make_unique<RMSpropParamState>(*r);
    c->square_avg(copy(r->square_avg()));
    c->momentum_buffer(copy(r->momentum_buffer()));
    c->grad_avg(copy(r->grad_avg()));
    return c;
  }
  return nullptr;
}

std::string state_key(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

int cuda_devices() {
  return at::detail::getCUDAHooks().hasCUDA() ? at::detail::getCUDAHooks().getNumGPUs() : 0;
}

}  // namespace

SnapshotRing::SnapshotRing(std::size_t keep) : keep_(keep) {
  TORCH_CHECK(keep >= 1, "stepguard: snapshot_keep must be >= 1");
}

void SnapshotRing::take(std::int64_t step, const std::vector<at::Tensor>& params,
                        const torch::optim::Optimizer& optimizer,
                        std::vector<std::int64_t> guard_state) {
  at::NoGradGuard no_grad;
  Snapshot s;
  s.step = step;
  s.guard = std::move(guard_state);
  s.params.reserve(params.size());
  for (const auto& p : params) s.params.push_back(host_copy(p, &s.bytes));
  bool typed = true;
  for (const auto& [key, state] : optimizer.state()) {
    auto copy = copy_state(*state, [&s](const at::Tensor& t) { return host_copy(t, &s.bytes); });
    if (!copy) {
      typed = false;
      break;
    }
    s.state_keys.push_back(key);
    s.states.push_back(std::move(copy));
  }
  if (!typed) {
    // An optimizer stepguard has no typed copy for: its own archive holds everything.
    s.state_keys.clear();
    s.states.clear();
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    s.optimizer_archive = bytes.str();
    s.bytes += static_cast<std::int64_t>(s.optimizer_archive.size());
  }
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.cpu_rng = gen.get_state();
  }
  for (int d = 0; d < cuda_devices(); ++d) {
    auto gen = at::globalContext().defaultGenerator(at::Device(at::kCUDA, d));
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.cuda_rng.push_back(gen.get_state());
  }
  ring_.push_back(std::move(s));
  while (ring_.size() > keep_) ring_.pop_front();
}

void SnapshotRing::on_step(std::int64_t step, bool clean) {
  if (ring_.empty() || ring_.back().confirmed || ring_.back().step != step - 1) return;
  if (clean) {
    ring_.back().confirmed = true;
  } else {
    ring_.pop_back();
  }
}

const Snapshot* SnapshotRing::newest_confirmed() const {
  for (auto it = ring_.rbegin(); it != ring_.rend(); ++it) {
    if (it->confirmed) return &*it;
  }
  return nullptr;
}

const Snapshot* SnapshotRing::confirmed_at(std::int64_t step) const {
  for (const auto& s : ring_) {
    if (s.confirmed && s.step == step) return &s;
  }
  return nullptr;
}

void SnapshotRing::restore(const Snapshot& snapshot, const std::vector<at::Tensor>& params,
                           torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(snapshot.params.size() == params.size(), "stepguard: the snapshot of step ",
              snapshot.step, " holds ", snapshot.params.size(), " parameters, the guard has ",
              params.size());
  std::unordered_map<std::string, at::Device> device_of;
  for (std::size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].sizes() == snapshot.params[i].sizes() &&
                    params[i].scalar_type() == snapshot.params[i].scalar_type(),
                "stepguard: parameter ", i, " changed shape or type since the snapshot of step ",
                snapshot.step);
    device_of.emplace(state_key(params[i]), params[i].device());
  }
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params.size(); ++i) params[i].detach().copy_(snapshot.params[i]);
  if (!snapshot.optimizer_archive.empty()) {
    torch::serialize::InputArchive archive;
    std::istringstream bytes(snapshot.optimizer_archive);
    archive.load_from(bytes);
    optimizer.load(archive);
  } else {
    auto& state = optimizer.state();
    state.clear();
    for (std::size_t i = 0; i < snapshot.states.size(); ++i) {
      const std::string& key = snapshot.state_keys[i];
      auto it = device_of.find(key);
      const at::Device device = it != device_of.end() ? it->second : at::Device(at::kCPU);
      state[key] = copy_state(*snapshot.states[i],
                              [&device](const at::Tensor& t) { return device_copy(t, device); });
    }
  }
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(snapshot.cpu_rng);
  }
  for (std::size_t d = 0; d < snapshot.cuda_rng.size(); ++d) {
    auto gen = at::globalContext().defaultGenerator(at::Device(at::kCUDA, static_cast<int>(d)));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(snapshot.cuda_rng[d]);
  }
  // The timeline after the snapshot is abandoned.
  const std::int64_t step = snapshot.step;
  while (!ring_.empty() && ring_.back().step > step) ring_.pop_back();
}

std::int64_t SnapshotRing::bytes() const noexcept {
  std::int64_t total = 0;
  for (const auto& s : ring_) total += s.bytes;
  return total;
}

}  // namespace checkpoint
}  // namespace stepguard
