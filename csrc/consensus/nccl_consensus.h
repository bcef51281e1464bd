/*
 * Consensus over a raw NCCL communicator, for jobs that do not hand stepguard a process group.
 * The ncclUniqueId is exchanged through a c10d Store (rank 0 creates it); the step buffer is
 * all-reduced in place on the device, on the legacy default stream, and the host polls for
 * completion so a dead peer cannot hang it: on the deadline, or on an asynchronous NCCL error, the
 * communicator is aborted and a ConsensusError names the step.
 *
 * Built only when CUDA and NCCL are found; runs only on a machine with a GPU.
 */
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>

#include "csrc/consensus/consensus.h"

namespace stepguard {
namespace consensus {

/// Not thread-safe: one guard drives one instance.
class NcclConsensus final : public Consensus {
 public:
  /// Bootstraps a communicator of `world_size` ranks on CUDA device `device`; throws
  /// ConsensusError when the rendezvous or NCCL initialization misses `timeout`.
  NcclConsensus(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, int device,
                std::chrono::milliseconds timeout);
  ~NcclConsensus() override;
  NcclConsensus(const NcclConsensus&) = delete;
  NcclConsensus& operator=(const NcclConsensus&) = delete;

  int rank() const noexcept override { return rank_; }
  int world_size() const noexcept override { return world_size_; }
  const char* backend_name() const noexcept override { return "nccl"; }

 protected:
  /// `buffer` must live on this instance's CUDA device.
  void do_all_reduce_sum(at::Tensor& buffer, std::int64_t step) override;

 private:
  struct Comm;
  std::unique_ptr<Comm> comm_;
  int rank_;
  int world_size_;
  int device_;
  std::chrono::milliseconds timeout_;
};

}  // namespace consensus
}  // namespace stepguard
