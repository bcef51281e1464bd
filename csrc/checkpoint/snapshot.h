/*
 * RAM snapshots for in-process rollback: a ring of the newest K copies of everything training
 * continues from (parameters, optimizer state, RNG state, the guard's decision state), taken on
 * cadence and restored when the policy rolls back.
 *
 * A snapshot is taken after an applied step and is *confirmed* by the next step: a clean next step
 * confirms it; a next step that raises any signal discards it (the update that produced it is the
 * suspect, e.g. a learning-rate spike shows only in the following step's loss). Rollback goes to
 * the newest confirmed snapshot.
 *
 * Copies live in host memory. Optimizer state is deep-copied tensor by tensor for LibTorch's Adam,
 * AdamW, SGD, Adagrad and RMSprop; any other optimizer goes through its own serialize archive.
 * Not here: disk checkpoints. Not thread-safe: the training thread owns the ring.
 */
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

namespace stepguard {
namespace checkpoint {

/// One point training can continue from.
struct Snapshot {
  std::int64_t step = 0;  ///< the guard step after which it was taken
  bool confirmed = false;
  std::vector<at::Tensor> params;  ///< host copies, in the guard's parameter order
  std::vector<std::string> state_keys;
  std::vector<std::unique_ptr<torch::optim::OptimizerParamState>> states;  ///< deep copies
  std::string optimizer_archive;  ///< for optimizers without a typed copy; empty otherwise
  at::Tensor cpu_rng;
  std::vector<at::Tensor> cuda_rng;  ///< one per visible device, when CUDA is available
  std::vector<std::int64_t> guard;   ///< the guard's decision state (StepController words)
  std::int64_t bytes = 0;            ///< host bytes held by the tensors above
  std::uint64_t checksum = 0;        ///< XXH3-64 over the host copies, checked before a restore
};

class SnapshotRing {
 public:
  /// Keeps at most `keep` (>= 1) snapshots.
  explicit SnapshotRing(std::size_t keep);

  /// Copies the state after `step` (unconfirmed). Drops the oldest beyond `keep`.
  void take(std::int64_t step, const std::vector<at::Tensor>& params,
            const torch::optim::Optimizer& optimizer, std::vector<std::int64_t> guard_state);
  /// After every step: confirms the newest snapshot when `clean`, discards it when not (only the
  /// snapshot taken at the previous step is pending).
  void on_step(std::int64_t step, bool clean);
  /// The newest confirmed snapshot, or nullptr.
  const Snapshot* newest_confirmed() const;
  /// The newest confirmed snapshot whose copies still match their checksum, or nullptr. Damaged
  /// ones are dropped and reported in `dropped` (one line each).
  const Snapshot* newest_valid(std::vector<std::string>* dropped);
  /// The confirmed snapshot of `step`, or nullptr.
  const Snapshot* confirmed_at(std::int64_t step) const;
  /// Drops every snapshot (after a resume from disk).
  void clear() noexcept { ring_.clear(); }
  /// Writes `snapshot` back into the parameters, the optimizer and the RNGs, and drops every
  /// snapshot newer than it. Throws c10::Error (changing nothing) when the parameters do not
  /// match the snapshot.
  void restore(const Snapshot& snapshot, const std::vector<at::Tensor>& params,
               torch::optim::Optimizer& optimizer);

  std::size_t size() const noexcept { return ring_.size(); }
  std::int64_t bytes() const noexcept;

 private:
  std::size_t keep_;
  std::deque<Snapshot> ring_;  ///< oldest first
};

}  // namespace checkpoint
}  // namespace stepguard
