#include "plugin/src/recovery.h"

#include <unistd.h>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>

#include "csrc/checkpoint/disk_checkpoint.h"

namespace stepguard {

namespace {

constexpr const char* kOptimizerPrefix = "optimizer.";

bool is_optimizer_tensor(const NamedTensor& t) { return t.name.rfind(kOptimizerPrefix, 0) == 0; }

// The optimizer's part of a saved set, under the port's own names.
std::vector<NamedTensor> optimizer_part(const std::vector<NamedTensor>& saved) {
  std::vector<NamedTensor> out;
  const std::size_t skip = std::char_traits<char>::length(kOptimizerPrefix);
  for (const auto& t : saved) {
    if (is_optimizer_tensor(t)) out.push_back({t.name.substr(skip), t.tensor});
  }
  return out;
}

std::vector<NamedTensor> model_part(const std::vector<NamedTensor>& tensors) {
  std::vector<NamedTensor> out;
  for (const auto& t : tensors) {
    if (!is_optimizer_tensor(t)) out.push_back(t);
  }
  return out;
}

constexpr const char* kBufferPrefix = "buffer.";

}  // namespace

Recovery::Recovery(consensus::Consensus& consensus, OptimizerPort& port, RecoveryConfig config)
    : consensus_(consensus),
      port_(port),
      config_(std::move(config)),
      book_(config_.snapshot_every, config_.snapshot_keep) {
  if (config_.snapshot_every > 0 && config_.snapshot_keep > 0) {
    ring_ =
        std::make_unique<checkpoint::SnapshotRing>(static_cast<std::size_t>(config_.snapshot_keep));
  }
  if (config_.checkpoint_dir.empty()) config_.disk_every = 0;
  if (!config_.run_id.empty()) {
    const std::string bad = checkpoint::run_id_problem(config_.run_id);
    TORCH_CHECK(bad.empty(), "stepguard: option run_id '", config_.run_id, "': ", bad);
  }
}

Recovery::~Recovery() {
  // The writer finishes its jobs first (they hold what they read), then the copies are released
  // here, on the training thread.
  writer_.reset();
  disk_copy_.release_sources();
  if (dir_lock_ >= 0) ::close(dir_lock_);  // the directory is free for another run
}

at::Device Recovery::device() const {
  const auto& params = port_.parameters();
  return params.empty() ? at::Device(at::kCPU) : params.front().device();
}

std::vector<NamedTensor> Recovery::training_tensors() const {
  std::vector<NamedTensor> out;
  const auto& params = port_.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    out.push_back({"param." + std::to_string(i), params[i]});
  }
  for (std::size_t i = 0; i < buffers_.size(); ++i) {
    out.push_back({kBufferPrefix + std::to_string(i), buffers_[i]});
  }
  for (auto& t : port_.state_tensors()) {
    out.push_back({kOptimizerPrefix + t.name, std::move(t.tensor)});
  }
  return out;
}

std::vector<NamedTensor> Recovery::frozen_tensors() const {
  std::vector<NamedTensor> out = training_tensors();
  at::NoGradGuard no_grad;
  for (auto& t : out) {
    if (t.tensor.defined() && t.name.rfind(kBufferPrefix, 0) == 0) t.tensor = t.tensor.clone();
  }
  return out;
}

void Recovery::begin_snapshot(std::int64_t step, std::vector<std::int64_t> guard_words) {
  if (!ring_) return;
  finish_snapshot();  // one copy in flight at a time (the engine has waited already)
  std::string opaque = port_.state_bytes();  // here: a Python port pickles under the GIL
  ring_->begin_take(step, frozen_tensors(), std::move(opaque), guard_words);
  book_.add(step, std::move(guard_words));
  ring_->keep_only(book_.steps());
}

void Recovery::finish_snapshot() {
  if (disk_copy_.valid()) {
    // Only the wait matters here; how the copy went is the disk write's to report.
    disk_copy_.release_sources();
    disk_copy_ = checkpoint::SnapshotCopy();
  }
  if (!ring_) return;
  try {
    ring_->finish_take();
  } catch (...) {
    // The ring lacks the failed copy and the snapshot whose buffers it refilled: so does the book.
    for (std::int64_t s : book_.steps()) {
      if (ring_->at(s) == nullptr) book_.drop(s);
    }
    throw;
  }
}

void Recovery::on_step(std::int64_t step, bool clean) {
  book_.on_step(step, clean);
  if (ring_) ring_->keep_only(book_.steps());
}

void Recovery::clear_snapshots() {
  finish_snapshot();
  book_.clear();
  if (ring_) ring_->keep_only({});
}

std::optional<RollbackTarget> Recovery::roll_back(std::int64_t step, bool replicas_diverged) {
  finish_snapshot();
  const std::vector<std::int64_t> confirmed = book_.candidates(replicas_diverged);
  std::int64_t mine = 0;
  for (std::int64_t candidate : confirmed) {
    const checkpoint::Snapshot* s = ring_ ? ring_->at(candidate) : nullptr;
    if (s != nullptr && ring_->intact(*s)) {
      mine = candidate;
      break;
    }
    std::fprintf(stderr,
                 "stepguard: step %" PRId64 ": the RAM snapshot of step %" PRId64
                 " no longer matches its checksum (host memory corrupted); dropped\n",
                 step, candidate);
    if (ring_) ring_->drop(candidate);
    book_.drop(candidate);
  }
  // Every rank must restore the same step: the newest one all of them hold.
  const auto all = consensus::gather_values(consensus_, mine, step, device());
  const std::int64_t agreed = *std::min_element(all.begin(), all.end());
  if (!confirmed.empty() && mine == 0) {
    throw RollbackFailure(
        "every RAM snapshot failed its checksum; nothing is left to roll back to");
  }
  if (agreed > 0 && (ring_ == nullptr || ring_->at(agreed) == nullptr)) {
    throw RollbackFailure("rank " + std::to_string(consensus_.rank()) +
                          " holds no snapshot of step " + std::to_string(agreed) +
                          ", the newest every rank holds");
  }
  if (agreed == 0) return std::nullopt;
  RollbackTarget target{agreed, book_.at(agreed)->words};
  book_.drop_newer_than(agreed);
  ring_->keep_only(book_.steps());
  return target;
}

void Recovery::restore_snapshot(std::int64_t step) {
  finish_snapshot();
  const checkpoint::Snapshot* s = ring_ ? ring_->at(step) : nullptr;
  TORCH_CHECK(s != nullptr, "stepguard: no RAM snapshot of step ", step);
  const std::string source = "the RAM snapshot of step " + std::to_string(step);
  check_restorable(s->tensors, s->opaque, s->rng, source);
  restore(s->tensors, s->opaque, s->rng, source, /*settings=*/false);
}

void Recovery::check_restorable(const std::vector<NamedTensor>& saved, const std::string& opaque,
                                const checkpoint::RngState& rng, const std::string& source) const {
  try {
    checkpoint::check_fits(model_part(saved), model_part(training_tensors()), source);
    // One check of the optimizer's tensors for every port; then what only the port can read.
    checkpoint::check_optimizer_tensors(optimizer_part(saved), port_.state_tensors(),
                                        port_.parameters().size(), source);
    port_.check_state_bytes(opaque, optimizer_part(saved));
  } catch (const checkpoint::CheckpointError& e) {
    TORCH_CHECK(false, "stepguard: ", e.what());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, source, ": ", e.msg());
  }
  const checkpoint::RngState now = checkpoint::capture_rng();
  TORCH_CHECK(rng.cpu.defined() && rng.cpu.scalar_type() == now.cpu.scalar_type() &&
                  rng.cpu.sizes() == now.cpu.sizes(),
              "stepguard: ", source, ": its CPU random-generator state is malformed");
  for (std::size_t d = 0; d < rng.cuda.size() && d < now.cuda.size(); ++d) {
    TORCH_CHECK(rng.cuda[d].sizes() == now.cuda[d].sizes(), "stepguard: ", source,
                ": its CUDA random-generator state of device ", d, " is malformed");
  }
  // Of the right size is not enough: tried on a scratch generator before anything is loaded.
  try {
    checkpoint::check_rng(rng);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "stepguard: ", source, ": ", e.msg());
  }
}

void Recovery::restore(const std::vector<NamedTensor>& saved, const std::string& opaque,
                       const checkpoint::RngState& rng, const std::string& source, bool settings) {
  port_.load_state_bytes(opaque, optimizer_part(saved), settings);
  const std::vector<NamedTensor> live = training_tensors();
  try {
    checkpoint::check_fits(saved, live, source);
  } catch (const checkpoint::CheckpointError& e) {
    TORCH_CHECK(false, "stepguard: ", e.what());
  }
  checkpoint::copy_into(saved, live);
  checkpoint::restore_rng(rng);
  port_.after_restore();
}

std::int64_t Recovery::newest_loadable(const std::vector<checkpoint::CheckpointEntry>& entries,
                                       std::int64_t bound) const {
  const int rank = consensus_.rank();
  const int world = consensus_.world_size();
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (it->step >= bound) continue;
    if (it->world_size != world) {
      std::fprintf(stderr, "stepguard: skipping %s: written by %d ranks, this run has %d\n",
                   it->dir.c_str(), it->world_size, world);
      continue;
    }
    try {
      checkpoint::read_rank_file(*it, rank);
      return it->step;
    } catch (const checkpoint::CheckpointError& e) {
      std::fprintf(stderr, "stepguard: skipping a bad checkpoint: %s\n", e.what());
    }
  }
  return 0;
}

bool Recovery::load_agreed(const std::vector<checkpoint::CheckpointEntry>& entries,
                           std::int64_t step,
                           const std::function<void(const checkpoint::GuardRecord&)>& check,
                           std::optional<checkpoint::DecodedPayload>* loaded) const {
  for (const auto& e : entries) {
    if (e.step != step) continue;
    const std::string source = e.dir + "/rank " + std::to_string(consensus_.rank());
    try {
      checkpoint::DecodedPayload p =
          checkpoint::decode_payload(checkpoint::read_rank_file(e, consensus_.rank()), source);
      if (p.record.step != step) {
        throw checkpoint::CheckpointError(source + ": holds step " + std::to_string(p.record.step) +
                                          ", its directory says " + std::to_string(step));
      }
      check(p.record);
      check_restorable(p.tensors, p.opaque, p.rng, source);
      *loaded = std::move(p);
      return true;
    } catch (const c10::Error& err) {
      std::fprintf(stderr, "stepguard: cannot resume from %s: %s\n", e.dir.c_str(),
                   err.msg().c_str());
    } catch (const std::exception& err) {
      std::fprintf(stderr, "stepguard: cannot resume from %s: %s\n", e.dir.c_str(), err.what());
    }
  }
  return false;
}

std::vector<checkpoint::CheckpointEntry> Recovery::resumable_entries(const std::string& dir) const {
  // One run's checkpoints only: the given run id's, or the only run's in the directory.
  std::vector<checkpoint::CheckpointEntry> entries = checkpoint::list_checkpoints(dir);
  std::string run = config_.run_id;
  if (run.empty()) {
    const auto runs = checkpoint::runs_under(dir);
    std::string names;
    for (const auto& r : runs) names += (names.empty() ? "'" : ", '") + r + "'";
    TORCH_CHECK(runs.size() <= 1, "stepguard: ", dir, " holds checkpoints of several runs (", names,
                "); say which to resume with run_id");
    if (!runs.empty()) run = runs.front();
  }
  entries.erase(std::remove_if(entries.begin(), entries.end(),
                               [&](const checkpoint::CheckpointEntry& e) { return e.run != run; }),
                entries.end());
  return entries;
}

void Recovery::check_world_size(const std::vector<checkpoint::CheckpointEntry>& entries) const {
  // Each rank resumes from its own file: the newest checkpoint needs as many ranks as wrote it.
  if (entries.empty()) return;
  const checkpoint::CheckpointEntry& newest = entries.back();
  const int world = consensus_.world_size();
  if (newest.world_size == world) return;
  const std::string why = port_.sharded_state()
                              ? "the optimizer state is sharded across the ranks (each rank's "
                                "file holds only its own shard), so it cannot be split anew"
                              : "each rank resumes from its own rank file";
  TORCH_CHECK(false, "stepguard: cannot resume from ", newest.dir, ": it was saved by ",
              newest.world_size, " ranks and this run has ", world, "; ", why, ". Resume with ",
              newest.world_size, " ranks.");
}

std::optional<checkpoint::GuardRecord> Recovery::resume(
    const std::string& dir, const std::function<void(const checkpoint::GuardRecord&)>& check) {
  finish_snapshot();
  wait_for_checkpoint();  // no write of this run runs while its directory is read
  const auto entries = resumable_entries(dir);
  check_world_size(entries);
  std::int64_t bound = std::numeric_limits<std::int64_t>::max();
  for (std::size_t round = 0; round <= entries.size(); ++round) {
    // This rank's newest valid checkpoint below the bound, then the newest all ranks hold.
    const std::int64_t mine = newest_loadable(entries, bound);
    const auto all = consensus::gather_values(consensus_, mine, -1, device());
    const std::int64_t agreed = *std::min_element(all.begin(), all.end());
    if (agreed == 0) return std::nullopt;
    std::optional<checkpoint::DecodedPayload> loaded;
    const bool ok = load_agreed(entries, agreed, check, &loaded);
    const auto oks = consensus::gather_values(consensus_, ok ? 1 : 0, -1, device());
    if (std::all_of(oks.begin(), oks.end(), [](std::int64_t v) { return v == 1; })) {
      // Checked everywhere: only now does anything change.
      restore(loaded->tensors, loaded->opaque, loaded->rng,
              checkpoint::step_dir(dir, agreed) + "/rank " + std::to_string(consensus_.rank()),
              /*settings=*/true);
      if (ring_) ring_->clear();
      pending_step_ = 0;  // a pending directory is never loaded; a later commit clears it
      pending_write_ = std::future<void>();
      resumed_from_ = dir;
      for (const auto& e : entries) {
        if (e.step == agreed && !e.run.empty()) run_ = e.run;  // the run goes on
      }
      return loaded->record;
    }
    bound = agreed;  // some rank could not load it: try an older one
  }
  return std::nullopt;
}

}  // namespace stepguard
