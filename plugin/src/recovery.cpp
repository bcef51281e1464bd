#include "plugin/src/recovery.h"

#include <unistd.h>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>

#include "csrc/checkpoint/dir_lock.h"
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

// Run ids travel through gather_values as exact doubles: at most 52 bits.
constexpr std::int64_t kRunBits = (std::int64_t{1} << 52) - 1;

std::string run_hex(std::int64_t v) {
  char hex[16];
  std::snprintf(hex, sizeof hex, "%013" PRIx64, static_cast<std::uint64_t>(v));
  return hex;
}

bool same_dir(const std::string& a, const std::string& b) {
  std::error_code ea, eb;
  const auto ca = std::filesystem::weakly_canonical(a, ea);
  const auto cb = std::filesystem::weakly_canonical(b, eb);
  return (ea || eb) ? a == b : ca == cb;
}

constexpr const char* kBufferPrefix = "buffer.";

checkpoint::TestHook write_hook;

}  // namespace

void Recovery::set_write_hook_for_testing(std::function<void(std::int64_t)> hook) {
  write_hook.set(std::move(hook));
}

Recovery::Recovery(consensus::Consensus& consensus, OptimizerPort& port, RecoveryConfig config)
    : consensus_(consensus), port_(port), config_(std::move(config)) {
  if (config_.snapshot_keep > 0) {
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

void Recovery::claim_checkpoint_dir(std::int64_t step) {
  if (claimed_ || config_.disk_every <= 0) return;
  claimed_ = true;
  // A run id given or adopted by resume() is checked for equality across ranks; otherwise
  // rank 0's random one is everyone's.
  const bool chosen = !run_.empty() || !config_.run_id.empty();
  if (run_.empty()) run_ = config_.run_id;
  std::string refusal;
  if (consensus_.rank() == 0) {
    // From now on the directory is this run's while it lives: a second run started on it is
    // refused here, before either has written a checkpoint.
    std::string holder;
    try {
      dir_lock_ = checkpoint::lock_checkpoint_dir(config_.checkpoint_dir, &holder);
    } catch (const checkpoint::CheckpointError& e) {
      // A directory that cannot be made or opened is no other run's: its writes will fail,
      // be logged and counted, and training goes on, as for any checkpoint that cannot be written.
      std::fprintf(stderr, "stepguard: cannot lock checkpoint_dir: %s\n", e.what());
    }
    if (dir_lock_ < 0 && !holder.empty()) {
      refusal = "stepguard: checkpoint_dir " + config_.checkpoint_dir +
                " is in use by another live run (" + holder +
                "): give each run its own directory. Nothing was written.";
    }
  }
  if (refusal.empty() &&
      (resumed_from_.empty() || !same_dir(config_.checkpoint_dir, resumed_from_))) {
    for (const std::string& other : checkpoint::runs_under(config_.checkpoint_dir)) {
      if (chosen && other == run_) continue;
      refusal = "stepguard: checkpoint_dir " + config_.checkpoint_dir +
                " holds checkpoints of another run ('" + (other.empty() ? "unnamed" : other) +
                "'; see `stepguard ckpt ls`): resume from it (resume() / --resume), give this "
                "run that run's id (run_id), or use another directory. Nothing was written.";
      break;
    }
  }
  std::int64_t mine = 0;
  if (chosen) {
    mine = static_cast<std::int64_t>(std::hash<std::string>{}(run_)&kRunBits);
  } else {
    std::random_device device_entropy;  // never the training RNG: runs stay reproducible
    mine = ((static_cast<std::int64_t>(device_entropy()) << 32) ^ device_entropy()) & kRunBits;
  }
  const auto all =
      consensus::gather_values(consensus_, refusal.empty() ? mine : -1, step, device());
  TORCH_CHECK(refusal.empty(), refusal);
  for (std::size_t r = 0; r < all.size(); ++r) {
    TORCH_CHECK(all[r] >= 0, "stepguard: rank ", r, " refused checkpoint_dir ",
                config_.checkpoint_dir,
                " (another run's checkpoints are there, or another live run uses it; see rank ", r,
                "'s error)");
    TORCH_CHECK(!chosen || all[r] == all[0], "stepguard: the ranks were given different run ids ",
                "(rank 0 and rank ", r, " differ); give every rank the same run_id");
  }
  if (!chosen) run_ = run_hex(all[0]);
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
  ring_->begin_take(step, frozen_tensors(), std::move(opaque), std::move(guard_words));
}

void Recovery::finish_snapshot() {
  if (disk_copy_.valid()) {
    // Only the wait matters here; how the copy went is the disk write's to report.
    disk_copy_.release_sources();
    disk_copy_ = checkpoint::SnapshotCopy();
  }
  if (ring_) ring_->finish_take();
}

std::int64_t Recovery::agree_rollback(std::int64_t step, const std::vector<std::int64_t>& confirmed,
                                      std::vector<std::int64_t>* damaged) {
  finish_snapshot();
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
    damaged->push_back(candidate);
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
  return agreed;
}

void Recovery::restore_snapshot(std::int64_t step) {
  finish_snapshot();
  const checkpoint::Snapshot* s = ring_ ? ring_->at(step) : nullptr;
  TORCH_CHECK(s != nullptr, "stepguard: no RAM snapshot of step ", step);
  const std::string source = "the RAM snapshot of step " + std::to_string(step);
  check_restorable(s->tensors, s->opaque, s->rng, source);
  restore(s->tensors, s->opaque, s->rng, source);
}

void Recovery::keep_snapshots(const std::vector<std::int64_t>& steps) {
  if (ring_) ring_->keep_only(steps);
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
}

void Recovery::restore(const std::vector<NamedTensor>& saved, const std::string& opaque,
                       const checkpoint::RngState& rng, const std::string& source) {
  port_.load_state_bytes(opaque, optimizer_part(saved));
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

bool Recovery::disk_due(std::int64_t step, bool applied) const noexcept {
  return config_.disk_every > 0 && applied && step % config_.disk_every == 0;
}

checkpoint::BackgroundThread& Recovery::writer() {
  if (!writer_) writer_ = std::make_unique<checkpoint::BackgroundThread>("sg-ckpt-writer");
  return *writer_;
}

bool Recovery::write_checkpoint(const checkpoint::GuardRecord& record) {
  if (pending_step_ != 0) {
    // One checkpoint in flight: host memory stays bounded and the ranks settle one at a time.
    ++checkpoints_skipped_;
    std::fprintf(stderr,
                 "stepguard: rank %d: step %" PRId64
                 ": disk checkpoint skipped: the one of step %" PRId64
                 " is still being written (the disk is slower than the checkpoint cadence)\n",
                 consensus_.rank(), record.step, pending_step_);
    return false;
  }
  pending_step_ = record.step;  // settled at a later step either way
  pending_verdict_ = Verdict::kOpen;
  pending_failed_ = false;
  pending_seen_ = false;
  pending_seconds_ = 0.0;
  try {
    // The RAM snapshot of this step when there is one; else a host copy of its own, made on the
    // writer thread before the write (the training thread waits for it, not for the write).
    checkpoint::SnapshotCopy copy =
        ring_ ? ring_->copy_of(record.step) : checkpoint::SnapshotCopy();
    if (!copy.valid()) {
      std::shared_ptr<const checkpoint::Snapshot> reuse = std::move(disk_spare_);
      if (reuse && reuse.use_count() != 1) reuse.reset();   // still held: never refilled
      std::atomic_thread_fence(std::memory_order_acquire);  // pairs with the holder's release
      disk_copy_ = checkpoint::start_copy(writer(), record.step, frozen_tensors(),
                                          port_.state_bytes(), {}, reuse, /*checksum=*/false);
      copy = disk_copy_;
      pending_copy_ = disk_copy_;
    }
    auto timer = std::make_shared<double>(0.0);
    pending_timer_ = timer;
    pending_write_ = writer().submit([copy, record, timer, dir = config_.checkpoint_dir, run = run_,
                                      rank = consensus_.rank()]() mutable {
      using Clock = std::chrono::steady_clock;
      // The job lets go of the copy before its future is ready: by then only the training
      // thread holds it (so its buffers can be refilled).
      struct Release {
        checkpoint::SnapshotCopy& copy;
        ~Release() { copy = checkpoint::SnapshotCopy(); }
      } release{copy};
      write_hook.run(record.step);
      const auto start = Clock::now();
      const std::shared_ptr<const checkpoint::Snapshot> s = copy.get();
      const checkpoint::EncodedPayload payload =
          checkpoint::encode_payload(record, s->tensors, s->opaque, s->rng);
      checkpoint::write_rank_file(dir, run, record.step, rank, payload.pieces());
      *timer = std::chrono::duration<double>(Clock::now() - start).count();
    });
  } catch (const std::exception& e) {
    // Nothing started (the opaque state could not be taken, no thread): a failed write.
    pending_write_ = std::future<void>();
    pending_seen_ = true;
    write_failed(e.what());
  }
  return true;
}

void Recovery::write_failed(const char* why) {
  pending_failed_ = true;
  ++checkpoint_failures_;
  std::fprintf(stderr,
               "stepguard: rank %d: step %" PRId64
               ": writing the disk checkpoint failed (%s); training goes on, the last good "
               "checkpoint stays\n",
               consensus_.rank(), pending_step_, why);
}

void Recovery::observe_write(bool wait) {
  if (pending_step_ == 0 || pending_seen_) return;
  if (!wait && pending_write_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    return;
  }
  pending_seen_ = true;
  try {
    pending_write_.get();
    pending_seconds_ = *pending_timer_;
  } catch (const std::exception& e) {
    write_failed(e.what());
  }
}

bool Recovery::checkpoint_written() {
  observe_write(false);
  return pending_step_ == 0 || pending_seen_;
}

void Recovery::wait_for_checkpoint() { observe_write(true); }

void Recovery::remove_later(std::vector<std::string> hidden) noexcept {
  if (hidden.empty()) return;
  try {
    // Behind the writes on the writer thread: the next commit comes after it.
    (void)writer().submit([hidden] { checkpoint::remove_hidden(hidden); });
  } catch (const std::exception&) {
    checkpoint::remove_hidden(hidden);
  }
}

bool Recovery::commit(std::int64_t step) {
  std::vector<std::string> hidden;  // pruned checkpoints, out of sight, deleted in the background
  try {
    checkpoint::commit_checkpoint(config_.checkpoint_dir, run_, step, consensus_.world_size(),
                                  config_.disk_keep, &hidden);
    remove_later(std::move(hidden));
    return true;
  } catch (const std::exception& e) {
    remove_later(std::move(hidden));
    ++checkpoint_failures_;
    std::fprintf(stderr,
                 "stepguard: step %" PRId64
                 ": committing the disk checkpoint failed (%s); it is discarded, the last good "
                 "checkpoint stays\n",
                 step, e.what());
    discard(step);
    return false;
  }
}

void Recovery::discard(std::int64_t step) noexcept {
  std::vector<std::string> hidden;
  try {
    checkpoint::discard_checkpoint(config_.checkpoint_dir, run_, step, &hidden);
    remove_later(std::move(hidden));
  } catch (const std::exception& e) {
    remove_later(std::move(hidden));
    // What is left is pending and never loaded; the next commit clears it.
    std::fprintf(stderr, "stepguard: step %" PRId64 ": removing a pending checkpoint failed (%s)\n",
                 step, e.what());
  }
}

std::int64_t Recovery::finish_pending(bool keep) {
  const std::int64_t pending = pending_step_;
  pending_step_ = 0;
  pending_write_ = std::future<void>();
  pending_timer_.reset();
  if (pending_copy_.valid()) {
    // Written: its buffers serve the next checkpoint that needs a copy of its own.
    if (!pending_failed_ && pending_copy_.finished()) {
      try {
        disk_spare_ = pending_copy_.get();
      } catch (const std::exception&) {
      }
    }
    pending_copy_ = checkpoint::SnapshotCopy();
  }
  // Rank 0 writes the manifest: every rank's write has finished (agreed by a collective).
  if (consensus_.rank() == 0) {
    if (keep && pending_failed_) {
      keep = false;  // counted when the write failed
      discard(pending);
    } else if (keep) {
      keep = commit(pending);
    } else {
      discard(pending);
    }
  }
  return keep ? pending : 0;
}

std::int64_t Recovery::settle_pending(std::int64_t step, bool clean, bool all_written) {
  if (pending_step_ == 0) return 0;
  if (pending_verdict_ == Verdict::kOpen) {
    pending_verdict_ = pending_step_ == step - 1 && clean ? Verdict::kKeep : Verdict::kDrop;
  }
  // Until every rank has finished writing, nobody commits or removes its directory.
  if (!all_written) return 0;
  observe_write(true);  // finished: this rank said so before the collective
  return finish_pending(pending_verdict_ == Verdict::kKeep);
}

std::int64_t Recovery::commit_pending() {
  if (pending_step_ == 0) return 0;
  observe_write(true);
  if (consensus_.world_size() > 1) {
    // Rank 0 commits only once every rank's file is written: each has waited for its own.
    (void)consensus::gather_values(consensus_, pending_failed_ ? 0 : 1, pending_step_, device());
  }
  return finish_pending(pending_verdict_ != Verdict::kDrop);
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
              checkpoint::step_dir(dir, agreed) + "/rank " + std::to_string(consensus_.rank()));
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
