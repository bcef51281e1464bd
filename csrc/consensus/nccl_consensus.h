/*
 * Consensus over a raw NCCL communicator, for jobs that do not hand stepguard a process group.
 * The ncclUniqueId is exchanged through a c10d Store (rank 0 creates it) under a key unique to
 * the instance; the communicator is non-blocking, so no NCCL call can hang the host.
 *
 * One step's all-reduce: an event recorded on the caller's stream (the legacy default stream
 * unless a stream is given) orders a dedicated stream after the work that produced the buffer;
 * the all-reduce is enqueued there (polling ncclCommGetAsyncError until NCCL has really queued
 * it: a non-blocking communicator may answer ncclInProgress first), a completion event recorded
 * behind it is made a dependency of the caller's stream, and the host polls that event. On the
 * deadline, or on an asynchronous NCCL error, the communicator is aborted and a ConsensusError
 * names the step and the rank. Destruction finalizes the communicator within the deadline and
 * aborts it when that runs out.
 *
 * Built only when CUDA and NCCL are found; runs only on a machine with a GPU.
 */
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "csrc/consensus/consensus.h"

// cudaStream_t is `CUstream_st*`; declared here so this header needs no CUDA include.
struct CUstream_st;

namespace stepguard {
namespace consensus {

/// Not thread-safe: one guard drives one instance.
class NcclConsensus final : public Consensus {
 public:
  /// Returns the stream the step buffer was written on and will be read on (with a CUDA LibTorch:
  /// `[d] { return c10::cuda::getCurrentCUDAStream(d).stream(); }`). Called once per step, with
  /// this instance's device current.
  using StreamFn = std::function<CUstream_st*()>;

  /// Bootstraps a communicator of `world_size` ranks on CUDA device `device`; throws
  /// ConsensusError when the rendezvous or NCCL initialization fails or misses `timeout` (each
  /// gets `timeout`). `timeout` is also each step's deadline and the destructor's.
  ///
  /// `store_key` names the store entry through which rank 0 hands out the NCCL id. Empty (the
  /// default): "stepguard/nccl/<n>/unique_id", where n counts the NcclConsensus instances this
  /// process has constructed so far, so every rank derives the same key as long as all ranks
  /// construct their instances in the same order (as they must create communicators anyway). The
  /// store is used as given (its timeout is not changed); it must not hold a key from an earlier
  /// run of the job (use a PrefixStore per restart, as torch's rendezvous does, or pass a key).
  ///
  /// `caller_stream`: see StreamFn. Empty (the default): the legacy default stream, which is
  /// torch's default stream; a torch side stream made with cudaStreamNonBlocking (every stream
  /// of torch's pool) is not ordered against it, so a caller on such a stream must pass it.
  NcclConsensus(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, int device,
                std::chrono::milliseconds timeout, std::string store_key = {},
                StreamFn caller_stream = {});
  /// Finalizes the communicator (waits for the other ranks' side of it, at most the timeout),
  /// then destroys it; aborts it instead when the timeout passes or NCCL reports an error.
  ~NcclConsensus() override;
  NcclConsensus(const NcclConsensus&) = delete;
  NcclConsensus& operator=(const NcclConsensus&) = delete;

  int rank() const noexcept override { return rank_; }
  int world_size() const noexcept override { return world_size_; }
  const char* backend_name() const noexcept override { return "nccl"; }
  /// The store key the NCCL id was exchanged under.
  const std::string& store_key() const noexcept { return store_key_; }

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
  std::string store_key_;
  StreamFn caller_stream_;
};

}  // namespace consensus
}  // namespace stepguard
