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

#include <xxhash.h>

#include <iterator>
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

// Assigns `src`'s fields to `dst` of the same state type: scalars by value, tensors through
// `put(dst_tensor, src_tensor)`, which returns what `dst` should hold (the same buffer refilled, or
// a new one). Returns false when the two are not of one known type.
template <typename Put>
bool assign_state(torch::optim::OptimizerParamState& dst,
                  const torch::optim::OptimizerParamState& src, Put put) {
  using namespace torch::optim;
  if (auto* a = dynamic_cast<const AdamWParamState*>(&src)) {
    auto* d = dynamic_cast<AdamWParamState*>(&dst);
    if (d == nullptr) return false;
    d->step(a->step());
    d->exp_avg(put(d->exp_avg(), a->exp_avg())).exp_avg_sq(put(d->exp_avg_sq(), a->exp_avg_sq()));
    d->max_exp_avg_sq(put(d->max_exp_avg_sq(), a->max_exp_avg_sq()));
    return true;
  }
  if (auto* a = dynamic_cast<const AdamParamState*>(&src)) {
    auto* d = dynamic_cast<AdamParamState*>(&dst);
    if (d == nullptr) return false;
    d->step(a->step());
    d->exp_avg(put(d->exp_avg(), a->exp_avg())).exp_avg_sq(put(d->exp_avg_sq(), a->exp_avg_sq()));
    d->max_exp_avg_sq(put(d->max_exp_avg_sq(), a->max_exp_avg_sq()));
    return true;
  }
  if (auto* g = dynamic_cast<const SGDParamState*>(&src)) {
    auto* d = dynamic_cast<SGDParamState*>(&dst);
    if (d == nullptr) return false;
    d->momentum_buffer(put(d->momentum_buffer(), g->momentum_buffer()));
    return true;
  }
  if (auto* g = dynamic_cast<const AdagradParamState*>(&src)) {
    auto* d = dynamic_cast<AdagradParamState*>(&dst);
    if (d == nullptr) return false;
    d->step(g->step());
    d->sum(put(d->sum(), g->sum()));
    return true;
  }
  if (auto* r = dynamic_cast<const RMSpropParamState*>(&src)) {
    auto* d = dynamic_cast<RMSpropParamState*>(&dst);
    if (d == nullptr) return false;
    d->step(r->step());
    d->square_avg(put(d->square_avg(), r->square_avg()));
    d->momentum_buffer(put(d->momentum_buffer(), r->momentum_buffer()));
    d->grad_avg(put(d->grad_avg(), r->grad_avg()));
    return true;
  }
  return false;
}

// A fresh state of `src`'s type with tensors from `put(undefined, src_tensor)`; nullptr for a
// state type without a typed copy.
template <typename Put>
std::unique_ptr<torch::optim::OptimizerParamState> copy_state(
    const torch::optim::OptimizerParamState& src, Put put) {
  using namespace torch::optim;
  std::unique_ptr<OptimizerParamState> fresh;
  if (dynamic_cast<const AdamWParamState*>(&src)) fresh = std::make_unique<AdamWParamState>();
  if (dynamic_cast<const AdamParamState*>(&src)) fresh = std::make_unique<AdamParamState>();
  if (dynamic_cast<const SGDParamState*>(&src)) fresh = std::make_unique<SGDParamState>();
  if (dynamic_cast<const AdagradParamState*>(&src)) fresh = std::make_unique<AdagradParamState>();
  if (dynamic_cast<const RMSpropParamState*>(&src)) fresh = std::make_unique<RMSpropParamState>();
  if (!fresh || !assign_state(*fresh, src, put)) return nullptr;
  return fresh;
}

// Refills `dst` with `src` when they match (no allocation: a snapshot or a restore of the same
// model costs a memcpy), else returns a new copy made by `make`.
template <typename Make>
at::Tensor refill(const at::Tensor& dst, const at::Tensor& src, Make make) {
  if (!src.defined()) return src;
  if (dst.defined() && dst.sizes() == src.sizes() && dst.scalar_type() == src.scalar_type() &&
      dst.is_contiguous()) {
    dst.copy_(src);
    return dst;
  }
  return make(src);
}

// XXH3-64 over a snapshot's host copies: parameters, optimizer state tensors, optimizer archive.
std::uint64_t checksum_of(const Snapshot& s) {
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  auto add = [h](const at::Tensor& t) {
    if (t.defined()) {
      XXH3_64bits_update(h, t.data_ptr(), static_cast<std::size_t>(t.numel() * t.element_size()));
    }
    return t;
  };
  for (const auto& p : s.params) add(p);
  for (const auto& st : s.states)
    copy_state(*st, [&add](const at::Tensor&, const at::Tensor& t) { return add(t); });
  XXH3_64bits_update(h, s.optimizer_archive.data(), s.optimizer_archive.size());
  const std::uint64_t out = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  return out;
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
  // The oldest snapshot's buffers are refilled when the ring is full: no allocation per snapshot.
  Snapshot s;
  Snapshot old;
  if (ring_.size() >= keep_) {
    old = std::move(ring_.front());
    ring_.pop_front();
  }
  s.step = step;
  s.guard = std::move(guard_state);
  s.params.reserve(params.size());
  std::int64_t* bytes = &s.bytes;
  auto host = [bytes](const at::Tensor& t) { return host_copy(t, bytes); };
  auto into_host = [bytes](const at::Tensor& dst, const at::Tensor& src) {
    if (!src.defined()) return src;
    at::Tensor out = refill(dst, src.detach(), [](const at::Tensor& t) {
      std::int64_t ignored = 0;
      return host_copy(t, &ignored);
    });
    if (out.defined()) *bytes += static_cast<std::int64_t>(out.numel() * out.element_size());
    return out;
  };
  for (std::size_t i = 0; i < params.size(); ++i) {
    s.params.push_back(i < old.params.size() && old.params[i].device().is_cpu()
                           ? into_host(old.params[i], params[i])
                           : host(params[i]));
  }
  std::unordered_map<std::string, std::size_t> old_index;
  for (std::size_t i = 0; i < old.state_keys.size(); ++i) old_index[old.state_keys[i]] = i;
  bool typed = true;
  for (const auto& [key, state] : optimizer.state()) {
    std::unique_ptr<torch::optim::OptimizerParamState> copy;
    if (auto it = old_index.find(key); it != old_index.end() && old.states[it->second] &&
                                       assign_state(*old.states[it->second], *state, into_host)) {
      copy = std::move(old.states[it->second]);
    } else {
      copy = copy_state(*state,
                        [&host](const at::Tensor&, const at::Tensor& src) { return host(src); });
    }
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
  s.checksum = checksum_of(s);
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

const Snapshot* SnapshotRing::newest_valid(std::vector<std::string>* dropped) {
  for (auto it = ring_.end(); it != ring_.begin();) {
    --it;
    if (!it->confirmed) continue;
    if (checksum_of(*it) == it->checksum) return &*it;
    if (dropped != nullptr) {
      dropped->push_back("the RAM snapshot of step " + std::to_string(it->step) +
                         " no longer matches its checksum (host memory corrupted); dropped");
    }
    it = ring_.erase(it);
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
    // Refilled in place where the live state matches (the common case: a memcpy per tensor),
    // created where it does not; states the snapshot did not have are dropped.
    auto& state = optimizer.state();
    std::unordered_map<std::string, bool> keep;
    for (std::size_t i = 0; i < snapshot.states.size(); ++i) {
      const std::string& key = snapshot.state_keys[i];
      keep[key] = true;
      auto it = device_of.find(key);
      const at::Device device = it != device_of.end() ? it->second : at::Device(at::kCPU);
      auto put = [&device](const at::Tensor& dst, const at::Tensor& src) {
        return refill(dst.defined() && dst.device() == device ? dst : at::Tensor(), src,
                      [&device](const at::Tensor& t) { return device_copy(t, device); });
      };
      auto live = state.find(key);
      if (live == state.end() || !live->second ||
          !assign_state(*live->second, *snapshot.states[i], put)) {
        state[key] = copy_state(*snapshot.states[i], put);
      }
    }
    for (auto it = state.begin(); it != state.end();) {
      it = keep.count(it->first) ? std::next(it) : state.erase(it);
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
