#include "csrc/checkpoint/snapshot.h"

#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <xxhash.h>

#include <algorithm>
#include <unordered_map>
#include <vector>

namespace stepguard {
namespace checkpoint {

namespace {

// A host copy of `src` that shares nothing with it, refilling `offered` when it matches (a full
// ring costs a memcpy per tensor, no allocation). A dense CUDA tensor goes to pinned memory by a
// non-blocking copy on its device's current stream and is complete only after
// PendingCopies::wait(); every other tensor is copied synchronously, as always.
at::Tensor host_copy(const at::Tensor& offered, const at::Tensor& src,
                     std::vector<c10::Device>* pending) {
  if (!src.defined()) return src;
  const at::Tensor s = src.detach();
  if (s.is_cuda() && s.layout() == at::kStrided) {
    // Pinned: a copy into pageable memory is staged and waits for the stream, once per tensor.
    at::Tensor dst = offered;
    if (!(dst.defined() && dst.sizes() == s.sizes() && dst.scalar_type() == s.scalar_type() &&
          dst.is_contiguous() && dst.is_pinned())) {
      dst = at::empty(s.sizes(), at::TensorOptions().dtype(s.scalar_type()).pinned_memory(true));
    }
    dst.copy_(s, /*non_blocking=*/true);
    if (std::find(pending->begin(), pending->end(), s.device()) == pending->end()) {
      pending->push_back(s.device());
    }
    return dst;
  }
  if (offered.defined() && offered.sizes() == s.sizes() &&
      offered.scalar_type() == s.scalar_type() && offered.is_contiguous()) {
    offered.copy_(s);
    return offered;
  }
  return s.device().is_cpu() ? s.clone(at::MemoryFormat::Contiguous) : s.to(at::kCPU).contiguous();
}

// XXH3-64 over a snapshot's host copies and opaque bytes.
std::uint64_t checksum_of(const Snapshot& s) {
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  for (const auto& t : s.tensors) {
    if (t.tensor.defined()) XXH3_64bits_update(h, t.tensor.data_ptr(), t.tensor.nbytes());
  }
  XXH3_64bits_update(h, s.opaque.data(), s.opaque.size());
  const std::uint64_t out = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  return out;
}

// Waits once per device for the non-blocking copies host_copy() enqueued on its current stream
// (also when take() is left by an exception, so no copy still writes into a buffer that goes back
// to the allocator or the ring). Through the generic c10 interface: libc10 only.
class PendingCopies {
 public:
  PendingCopies() = default;
  PendingCopies(const PendingCopies&) = delete;
  PendingCopies& operator=(const PendingCopies&) = delete;
  ~PendingCopies() {
    try {
      wait();
    } catch (...) {  // a destructor must not throw; the CUDA error resurfaces at the next call
    }
  }
  std::vector<c10::Device>* devices() { return &devices_; }
  void wait() {
    while (!devices_.empty()) {
      const c10::Device d = devices_.back();
      devices_.pop_back();
      c10::impl::VirtualGuardImpl(d.type()).getStream(d).synchronize();
    }
  }

 private:
  std::vector<c10::Device> devices_;
};

}  // namespace

SnapshotRing::SnapshotRing(std::size_t keep) : keep_(keep) {
  TORCH_CHECK(keep >= 1, "stepguard: snapshot_keep must be >= 1");
}

void SnapshotRing::take(std::int64_t step, const std::vector<NamedTensor>& tensors,
                        std::string opaque, std::vector<std::int64_t> guard_state) {
  at::NoGradGuard no_grad;
  Snapshot old;
  if (ring_.size() >= keep_) {
    old = std::move(ring_.front());
    ring_.pop_front();
  }
  std::unordered_map<std::string, std::size_t> old_index;
  for (std::size_t i = 0; i < old.tensors.size(); ++i) old_index[old.tensors[i].name] = i;
  Snapshot s;
  s.step = step;
  s.guard = std::move(guard_state);
  s.opaque = std::move(opaque);
  s.tensors.reserve(tensors.size());
  PendingCopies pending;  // declared after `old` and `s`: waits before their buffers can go
  for (const auto& t : tensors) {
    auto it = old_index.find(t.name);
    const at::Tensor offered =
        it != old_index.end() ? old.tensors[it->second].tensor : at::Tensor();
    s.tensors.push_back({t.name, host_copy(offered, t.tensor, pending.devices())});
  }
  // The one synchronization of a snapshot of CUDA tensors; the checksum reads the copies after it.
  pending.wait();
  s.rng = capture_rng();
  s.bytes = bytes_of(s.tensors) + static_cast<std::int64_t>(s.opaque.size());
  s.checksum = checksum_of(s);
  ring_.push_back(std::move(s));
  while (ring_.size() > keep_) ring_.pop_front();
}

const Snapshot* SnapshotRing::at(std::int64_t step) const {
  for (const auto& s : ring_) {
    if (s.step == step) return &s;
  }
  return nullptr;
}

bool SnapshotRing::intact(const Snapshot& snapshot) const {
  return checksum_of(snapshot) == snapshot.checksum;
}

void SnapshotRing::drop(std::int64_t step) {
  ring_.erase(std::remove_if(ring_.begin(), ring_.end(),
                             [step](const Snapshot& s) { return s.step == step; }),
              ring_.end());
}

void SnapshotRing::keep_only(const std::vector<std::int64_t>& steps) {
  ring_.erase(std::remove_if(ring_.begin(), ring_.end(),
                             [&steps](const Snapshot& s) {
                               return std::find(steps.begin(), steps.end(), s.step) == steps.end();
                             }),
              ring_.end());
}

std::int64_t SnapshotRing::bytes() const noexcept {
  std::int64_t total = 0;
  for (const auto& s : ring_) total += s.bytes;
  return total;
}

}  // namespace checkpoint
}  // namespace stepguard
