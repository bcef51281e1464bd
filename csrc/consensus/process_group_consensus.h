/*
 * Consensus over a c10d ProcessGroup: Gloo on CPU, or NCCL through torch on GPUs, so stepguard can
 * share the process group a training job already has. One all-reduce per step, with a deadline:
 * a dead or stuck rank makes the survivors fail with an error that names the step and, when the
 * rendezvous store can tell, the missing ranks, instead of hanging forever.
 *
 * Naming the dead exactly: a rank whose collective fails (its neighbours in the ring see a reset
 * at once; the others would wait out the deadline) checks in under the step in the store and
 * raises a failure count there. A rank still waiting looks at that count once its collective has
 * run longer than a second (every half second after), gives up when it is set, and checks in
 * too; so every live rank checks in within about a second of the first failure, and the ranks
 * that have not checked in after the grace are the dead ones. A clean step never touches the
 * store.
 */
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "csrc/consensus/consensus.h"

namespace stepguard {
namespace consensus {

/// A collective failed or missed its deadline. The message names the step and, where known, the
/// ranks that did not take part.
class ConsensusError : public std::runtime_error {
 public:
  ConsensusError(const std::string& message, std::int64_t step, std::vector<int> missing_ranks)
      : std::runtime_error(message), step_(step), missing_ranks_(std::move(missing_ranks)) {}
  std::int64_t step() const noexcept { return step_; }
  const std::vector<int>& missing_ranks() const noexcept { return missing_ranks_; }

 private:
  std::int64_t step_;
  std::vector<int> missing_ranks_;
};

/// Waits for `work` until it completes, `timeout` passes, or another rank has reported a failure
/// of `step` in `store` (may be null); throws on the two latter and rethrows the backend's own
/// error. The wait runs in slices (the store is looked at between them); a collective that
/// completes just as a slice runs out is complete, not failed.
void wait_for_collective(const c10::intrusive_ptr<c10d::Work>& work, c10d::Store* store,
                         std::chrono::milliseconds timeout, std::int64_t step);

/// Sums the step buffer over a c10d ProcessGroup. Not thread-safe: one guard drives one instance;
/// the process group may be shared with the training loop as long as collectives are issued in the
/// same order on every rank (as c10d requires anyway).
class ProcessGroupConsensus final : public Consensus {
 public:
  /// `store`, when given, is used only after a failure, to find which ranks are missing.
  ProcessGroupConsensus(c10::intrusive_ptr<c10d::ProcessGroup> group,
                        std::chrono::milliseconds timeout,
                        c10::intrusive_ptr<c10d::Store> store = {});

  int rank() const noexcept override { return rank_; }
  int world_size() const noexcept override { return world_size_; }
  const char* backend_name() const noexcept override { return backend_.c_str(); }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  /// Sums `tensors` across the ranks (any dtype the backend takes) with the same deadline and the
  /// same naming of missing ranks on failure (ConsensusError). `what` names the collective in
  /// the message ("gradient all-reduce").
  /// `host_waits` false: on device tensors the caller's stream waits for the sum instead of the
  /// host (NCCL's watchdog holds the deadline then); host tensors are always waited for.
  void all_reduce_tensors(std::vector<at::Tensor>& tensors, std::int64_t step,
                          const std::string& what, bool host_waits = true);

 protected:
  void do_all_reduce_sum(at::Tensor& buffer, std::int64_t step) override;
  void do_all_reduce_sum_on_stream(at::Tensor& buffer, std::int64_t step) override;

 private:
  // After a failed collective: ranks that did not check in through the store within a short
  // grace period. Empty when there is no store or it cannot be reached.
  std::vector<int> find_missing_ranks(std::int64_t step, std::string* note);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  int rank_;
  int world_size_;
  std::string backend_;
};

}  // namespace consensus
}  // namespace stepguard
