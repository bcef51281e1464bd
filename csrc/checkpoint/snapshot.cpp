#include "csrc/checkpoint/snapshot.h"

#include "csrc/checkpoint/optimizer_state.h"

#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <xxhash.h>

#include <iterator>
#include <map>
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

// A new state of `src`'s type whose tensors are `put(offered, src_tensor)`: `dst`, when it is a
// state of the same type, offers its buffers for refilling (no allocation), else `offered` is
// undefined. nullptr for a type without a field-by-field copy.
template <typename Put>
std::unique_ptr<torch::optim::OptimizerParamState> rebuild_state(
    const torch::optim::OptimizerParamState* dst, const torch::optim::OptimizerParamState& src,
    Put put) {
  std::string type, dst_type;
  std::int64_t step = 0, dst_step = 0;
  StateFields from, into;
  if (!read_fields(src, &type, &step, &from)) return nullptr;
  const bool offered = dst != nullptr && read_fields(*dst, &dst_type, &dst_step, &into) &&
                       dst_type == type && into.size() == from.size();
  std::map<std::string, at::Tensor> out;
  for (std::size_t i = 0; i < from.size(); ++i) {
    out[from[i].first] = put(offered ? into[i].second : at::Tensor(), from[i].second);
  }
  return make_state(type, step, out);
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
  for (const auto& st : s.states) {
    std::string type;
    std::int64_t step = 0;
    StateFields fields;
    read_fields(*st, &type, &step, &fields);
    for (const auto& f : fields) add(f.second);
  }
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
    s.params.push_back(into_host(i < old.params.size() ? old.params[i] : at::Tensor(), params[i]));
  }
  std::unordered_map<std::string, std::size_t> old_index;
  for (std::size_t i = 0; i < old.state_keys.size(); ++i) old_index[old.state_keys[i]] = i;
  bool typed = true;
  for (const auto& [key, state] : optimizer.state()) {
    auto it = old_index.find(key);
    std::unique_ptr<torch::optim::OptimizerParamState> copy = rebuild_state(
        it != old_index.end() ? old.states[it->second].get() : nullptr, *state, into_host);
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
      state[key] = rebuild_state(live != state.end() ? live->second.get() : nullptr,
                                 *snapshot.states[i], put);
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
