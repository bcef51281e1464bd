#include "csrc/checkpoint/snapshot.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <future>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace stepguard {
namespace checkpoint {

struct SnapshotCopy::State {
  std::shared_ptr<Snapshot> snapshot;  ///< filled by the copy
  std::vector<NamedTensor> sources;    ///< the live tensors it reads (released by the starter)
  std::vector<NamedTensor> offered;    ///< host buffers it may refill
  /// CUDA: an event on each device's current stream at the start; the copy waits for it.
  std::vector<std::pair<c10::Device, c10::Event>> producers;
  std::shared_future<void> done;
  bool checksum = true;
};

namespace {

TestHook copy_hook;

// The side stream of each device the copy reads from, ordered after that device's producer.
using SideStreams = std::vector<std::pair<c10::Device, c10::Stream>>;

const c10::Stream& side_stream_of(const SideStreams& side, const c10::Device& device) {
  for (const auto& [d, s] : side) {
    if (d == device) return s;
  }
  TORCH_CHECK(false, "stepguard: no side stream for ", device);  // every device got one
}

bool fits(const at::Tensor& offered, const at::Tensor& s) {
  return offered.defined() && offered.sizes() == s.sizes() &&
         offered.scalar_type() == s.scalar_type() && offered.is_contiguous();
}

// A host copy of `src` that shares nothing with it, refilling `offered` when it matches (a full
// ring costs one memcpy per tensor, no allocation). A dense CUDA tensor goes to pinned memory by
// a non-blocking copy on its device's side stream, complete only once that stream is
// synchronized; a dense CPU tensor is one memcpy (on this one thread: the training thread's
// intra-op threads stay its own); anything else is copied synchronously.
at::Tensor host_copy(const at::Tensor& offered, const at::Tensor& src, const SideStreams& side) {
  if (!src.defined()) return src;
  const at::Tensor s = src.detach();
  if (s.is_cuda() && s.layout() == at::kStrided) {
    // Pinned: a copy into pageable memory is staged and waits for the stream, once per tensor.
    at::Tensor dst = offered;
    if (!(fits(dst, s) && dst.is_pinned())) {
      dst = at::empty(s.sizes(), at::TensorOptions().dtype(s.scalar_type()).pinned_memory(true));
    }
    c10::StreamGuard on_side(side_stream_of(side, s.device()));
    dst.copy_(s, /*non_blocking=*/true);
    return dst;
  }
  if (s.device().is_cpu() && s.layout() == at::kStrided && s.is_contiguous() && !s.is_conj() &&
      !s.is_neg()) {
    at::Tensor dst =
        fits(offered, s) ? offered : at::empty(s.sizes(), at::TensorOptions().dtype(s.dtype()));
    if (s.nbytes() > 0) std::memcpy(dst.data_ptr(), s.data_ptr(), s.nbytes());
    return dst;
  }
  if (fits(offered, s)) {
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

// Synchronizes every side stream once, also when the copy is left by an exception (so no copy
// still writes into a buffer that goes back to the allocator). Through the generic c10
// interface: libc10 only.
class SideStreamsDone {
 public:
  explicit SideStreamsDone(const SideStreams& side) : side_(side) {}
  SideStreamsDone(const SideStreamsDone&) = delete;
  SideStreamsDone& operator=(const SideStreamsDone&) = delete;
  ~SideStreamsDone() {
    try {
      wait();
    } catch (...) {  // a destructor must not throw; the CUDA error resurfaces at the next call
    }
  }
  void wait() {
    for (; waited_ < side_.size(); ++waited_) side_[waited_].second.synchronize();
  }

 private:
  const SideStreams& side_;
  std::size_t waited_ = 0;
};

// The background half of a copy: every tensor into host memory, then the checksum.
void fill(SnapshotCopy::State& st) {
  copy_hook.run(st.snapshot->step);
  at::NoGradGuard no_grad;  // thread-local: this thread's own
  SideStreams side;
  for (auto& [device, ready] : st.producers) {
    const c10::Stream stream =
        c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
    ready.block(stream);  // the copy reads what the producer stream wrote before begin
    side.emplace_back(device, stream);
  }
  SideStreamsDone side_done(side);  // declared after nothing it must outlive: `st` owns the rest
  std::unordered_map<std::string, std::size_t> offered_index;
  for (std::size_t i = 0; i < st.offered.size(); ++i) offered_index[st.offered[i].name] = i;
  Snapshot& s = *st.snapshot;
  s.tensors.reserve(st.sources.size());
  for (const auto& t : st.sources) {
    auto it = offered_index.find(t.name);
    const at::Tensor offered =
        it != offered_index.end() ? st.offered[it->second].tensor : at::Tensor();
    s.tensors.push_back({t.name, host_copy(offered, t.tensor, side)});
  }
  side_done.wait();  // the one synchronization per device; the checksum reads the copies after it
  s.bytes = bytes_of(s.tensors) + static_cast<std::int64_t>(s.opaque.size());
  if (st.checksum) s.checksum = checksum_of(s);
  st.offered.clear();
}

// A tensor whose copy would call into Python (a subclass with __torch_dispatch__) is copied on the
// calling thread: the background thread never takes the GIL.
bool runs_python(const at::Tensor& t) {
  return t.defined() && t.key_set().has(c10::DispatchKey::Python);
}

}  // namespace

SnapshotCopy::SnapshotCopy(std::shared_ptr<const Snapshot> complete)
    : state_(std::make_shared<State>()) {
  state_->snapshot = std::const_pointer_cast<Snapshot>(std::move(complete));
  std::promise<void> ready;
  ready.set_value();
  state_->done = ready.get_future().share();
}

std::int64_t SnapshotCopy::step() const noexcept { return state_ ? state_->snapshot->step : 0; }

bool SnapshotCopy::finished() const {
  return state_ == nullptr ||
         state_->done.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

std::shared_ptr<const Snapshot> SnapshotCopy::get() const {
  TORCH_CHECK(state_ != nullptr, "stepguard: no snapshot copy");
  state_->done.get();
  return state_->snapshot;
}

void SnapshotCopy::release_sources() const {
  if (state_ == nullptr) return;
  state_->done.wait();
  state_->sources.clear();
  state_->sources.shrink_to_fit();
}

void set_copy_hook_for_testing(std::function<void(std::int64_t)> hook) {
  copy_hook.set(std::move(hook));
}

SnapshotCopy start_copy(BackgroundThread& thread, std::int64_t step,
                        std::vector<NamedTensor> tensors, std::string opaque,
                        std::vector<std::int64_t> guard_state,
                        const std::shared_ptr<const Snapshot>& reuse, bool checksum) {
  auto st = std::make_shared<SnapshotCopy::State>();
  st->checksum = checksum;
  st->snapshot = std::make_shared<Snapshot>();
  Snapshot& s = *st->snapshot;
  s.step = step;
  s.opaque = std::move(opaque);
  s.guard = std::move(guard_state);
  s.rng = capture_rng();
  {
    at::NoGradGuard no_grad;
    for (auto& t : tensors) {
      if (runs_python(t.tensor)) t.tensor = t.tensor.detach().to(at::kCPU, false, /*copy=*/true);
    }
  }
  for (const auto& t : tensors) {
    if (!t.tensor.defined() || !t.tensor.is_cuda() || t.tensor.layout() != at::kStrided) continue;
    const c10::Device d = t.tensor.device();
    const bool seen = std::any_of(st->producers.begin(), st->producers.end(),
                                  [&](const auto& p) { return p.first == d; });
    if (seen) continue;
    c10::Event ready(d.type());
    ready.record(c10::impl::VirtualGuardImpl(d.type()).getStream(d));
    st->producers.emplace_back(d, std::move(ready));
  }
  st->sources = std::move(tensors);
  if (reuse) st->offered = reuse->tensors;  // handles: the buffers themselves are refilled
  // The job holds the state only while it runs (its handles keep it alive until then): once the
  // copy is done, nothing in the background still counts as a holder of the snapshot.
  st->done = thread
                 .submit([weak = std::weak_ptr<SnapshotCopy::State>(st)] {
                   if (const auto held = weak.lock()) fill(*held);
                 })
                 .share();
  SnapshotCopy out;
  out.state_ = std::move(st);
  return out;
}

SnapshotRing::SnapshotRing(std::size_t keep) : keep_(keep) {
  TORCH_CHECK(keep >= 1, "stepguard: snapshot_keep must be >= 1");
}

SnapshotRing::~SnapshotRing() { clear(); }

BackgroundThread& SnapshotRing::thread() {
  if (!thread_) thread_ = std::make_unique<BackgroundThread>("sg-snapshot");
  return *thread_;
}

void SnapshotRing::begin_take(std::int64_t step, std::vector<NamedTensor> tensors,
                              std::string opaque, std::vector<std::int64_t> guard_state) {
  finish_take();
  std::shared_ptr<Snapshot> oldest;
  if (ring_.size() >= keep_) {
    oldest = std::move(ring_.front());
    ring_.pop_front();
  }
  // Refill the oldest one's buffers only when nobody else holds it (a disk write may still read
  // it); the fence pairs with the release of that holder's reference.
  std::shared_ptr<const Snapshot> reuse;
  if (oldest && oldest.use_count() == 1) {
    std::atomic_thread_fence(std::memory_order_acquire);
    reuse = oldest;
  }
  try {
    taking_ = start_copy(thread(), step, std::move(tensors), std::move(opaque),
                         std::move(guard_state), reuse);
  } catch (...) {
    if (oldest) ring_.push_front(std::move(oldest));  // no copy started: it is untouched
    throw;
  }
  drop_when_landed_ = false;
}

void SnapshotRing::finish_take() {
  if (!taking_.valid()) return;
  const SnapshotCopy copy = std::move(taking_);
  taking_ = SnapshotCopy();
  const bool dropped = drop_when_landed_;
  drop_when_landed_ = false;
  copy.release_sources();
  copy.get();  // throws what made the copy fail
  if (dropped) return;
  ring_.push_back(copy.state_->snapshot);
  while (ring_.size() > keep_) ring_.pop_front();
}

void SnapshotRing::take(std::int64_t step, const std::vector<NamedTensor>& tensors,
                        std::string opaque, std::vector<std::int64_t> guard_state) {
  begin_take(step, tensors, std::move(opaque), std::move(guard_state));
  finish_take();
}

SnapshotCopy SnapshotRing::copy_of(std::int64_t step) const {
  if (taking_.valid() && taking_.step() == step && !drop_when_landed_) return taking_;
  for (const auto& s : ring_) {
    if (s->step == step) return SnapshotCopy(s);
  }
  return SnapshotCopy();
}

const Snapshot* SnapshotRing::at(std::int64_t step) const {
  for (const auto& s : ring_) {
    if (s->step == step) return s.get();
  }
  return nullptr;
}

bool SnapshotRing::intact(const Snapshot& snapshot) const {
  return checksum_of(snapshot) == snapshot.checksum;
}

void SnapshotRing::drop(std::int64_t step) {
  if (taking_.valid() && taking_.step() == step) drop_when_landed_ = true;
  ring_.erase(
      std::remove_if(ring_.begin(), ring_.end(),
                     [step](const std::shared_ptr<Snapshot>& s) { return s->step == step; }),
      ring_.end());
}

void SnapshotRing::keep_only(const std::vector<std::int64_t>& steps) {
  auto kept = [&steps](std::int64_t step) {
    return std::find(steps.begin(), steps.end(), step) != steps.end();
  };
  if (taking_.valid() && !kept(taking_.step())) drop_when_landed_ = true;
  ring_.erase(std::remove_if(ring_.begin(), ring_.end(),
                             [&](const std::shared_ptr<Snapshot>& s) { return !kept(s->step); }),
              ring_.end());
}

void SnapshotRing::clear() noexcept {
  if (taking_.valid()) {
    taking_.release_sources();  // how it went no longer matters
    taking_ = SnapshotCopy();
  }
  drop_when_landed_ = false;
  ring_.clear();
}

std::int64_t SnapshotRing::bytes() const noexcept {
  std::int64_t total = 0;
  for (const auto& s : ring_) total += s->bytes;
  return total;
}

}  // namespace checkpoint
}  // namespace stepguard
