/*
 * Consensus: how the ranks of a job agree on one step's statistics. The engine packs everything a
 * decision needs into one small fp64 buffer (step_buffer.h) and calls all_reduce_sum() exactly
 * once per step; every rank then holds the same sums and, because the policy is a pure function of
 * them, decides the same. gather_values() is the rare extra exchange of rollback and resume.
 *
 * Not here: what is in the buffer (step_buffer.h) or what it means (the policy).
 */
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace stepguard {
namespace consensus {

/// The one collective a guarded step needs. Implementations count their collectives so tests can
/// assert the one-per-step invariant. Not thread-safe: one guard drives one instance.
class Consensus {
 public:
  virtual ~Consensus() = default;

  /// This process's rank in [0, world_size()).
  virtual int rank() const noexcept = 0;
  /// Number of ranks taking part.
  virtual int world_size() const noexcept = 0;
  /// Short name for logs ("local", "gloo", "nccl").
  virtual const char* backend_name() const noexcept = 0;

  /// Sums `buffer` elementwise across all ranks, in place. `buffer` is a contiguous 1-D float64
  /// tensor on the gradients' device, the same length on every rank. Blocks until the sum is
  /// available to the host or throws std::runtime_error naming the step when the deadline passes.
  void all_reduce_sum(at::Tensor& buffer, std::int64_t step);
  /// The same sum without the host's wait where the backend orders it on the device: for a
  /// device buffer the caller's stream waits for the sum and the host goes on (the deferred
  /// verdict); the backend's own watchdog then holds the deadline. A host buffer is summed as by
  /// all_reduce_sum(). Counted as one collective.
  void all_reduce_sum_on_stream(at::Tensor& buffer, std::int64_t step);

  /// Collectives issued so far by this instance.
  std::int64_t collectives() const noexcept { return collectives_; }
  /// Bytes those collectives carried (each buffer's size, counted once per collective).
  std::int64_t bytes() const noexcept { return bytes_; }

 protected:
  virtual void do_all_reduce_sum(at::Tensor& buffer, std::int64_t step) = 0;
  virtual void do_all_reduce_sum_on_stream(at::Tensor& buffer, std::int64_t step) {
    do_all_reduce_sum(buffer, step);
  }

 private:
  void count(const at::Tensor& buffer, std::int64_t step);
  std::int64_t collectives_ = 0;
  std::int64_t bytes_ = 0;
};

/// Every rank's `value`, in rank order, through one sum all-reduce of a buffer on `device`
/// (rare: agreeing on a rollback or resume target). `tag` names the exchange in errors.
std::vector<std::int64_t> gather_values(Consensus& consensus, std::int64_t value, std::int64_t tag,
                                        const at::Device& device);

/// World size 1: the sum over one rank is the buffer itself. Not thread-safe.
class LocalConsensus final : public Consensus {
 public:
  int rank() const noexcept override { return 0; }
  int world_size() const noexcept override { return 1; }
  const char* backend_name() const noexcept override { return "local"; }

 protected:
  void do_all_reduce_sum(at::Tensor& buffer, std::int64_t step) override;
};

}  // namespace consensus
}  // namespace stepguard
