#include "csrc/checkpoint/snapshot.h"

#include <c10/util/Exception.h>

#include <xxhash.h>

#include <algorithm>
#include <unordered_map>

namespace stepguard {
namespace checkpoint {

namespace {

// A host copy of `src` that shares nothing with it, refilling `offered` when it matches (a full
// ring costs a memcpy per tensor, no allocation).
at::Tensor host_copy(const at::Tensor& offered, const at::Tensor& src) {
  if (!src.defined()) return src;
  const at::Tensor s = src.detach();
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
  for (const auto& t : tensors) {
    auto it = old_index.find(t.name);
    const at::Tensor offered =
        it != old_index.end() ? old.tensors[it->second].tensor : at::Tensor();
    s.tensors.push_back({t.name, host_copy(offered, t.tensor)});
  }
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
