#include "csrc/consensus/nccl_consensus.h"

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <sstream>
#include <thread>

#include "csrc/common/cuda_check.h"
#include "csrc/consensus/process_group_consensus.h"

namespace stepguard {
namespace consensus {

namespace {
constexpr const char* kUniqueIdKey = "stepguard/nccl_unique_id";
using Clock = std::chrono::steady_clock;
}  // namespace

struct NcclConsensus::Comm {
  ncclComm_t comm = nullptr;
  bool aborted = false;
};

NcclConsensus::NcclConsensus(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                             int device, std::chrono::milliseconds timeout)
    : comm_(std::make_unique<Comm>()),
      rank_(rank),
      world_size_(world_size),
      device_(device),
      timeout_(timeout) {
  TORCH_CHECK(store, "stepguard: NcclConsensus needs a store to exchange the NCCL id");
  TORCH_CHECK(world_size > 0 && rank >= 0 && rank < world_size, "stepguard: rank ", rank,
              " is outside world size ", world_size);
  TORCH_CHECK(timeout.count() > 0, "stepguard: collective timeout must be positive");
  SG_CUDA_CHECK(cudaSetDevice(device_));

  ncclUniqueId id;
  store->setTimeout(timeout_);
  if (rank_ == 0) {
    SG_NCCL_CHECK(ncclGetUniqueId(&id));
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(&id);
    store->set(kUniqueIdKey, std::vector<std::uint8_t>(bytes, bytes + sizeof id));
  } else {
    const std::vector<std::uint8_t> bytes = store->get(kUniqueIdKey);  // waits up to timeout
    TORCH_CHECK(bytes.size() == sizeof id, "stepguard: NCCL id in the store has ", bytes.size(),
                " bytes, expected ", sizeof id);
    std::memcpy(&id, bytes.data(), sizeof id);
  }

  // Non-blocking init, so a rank that never arrives cannot hang this one.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t result = ncclCommInitRankConfig(&comm_->comm, world_size_, id, rank_, &config);
  const auto deadline = Clock::now() + timeout_;
  while (result == ncclInProgress || result == ncclSuccess) {
    ncclResult_t state = ncclSuccess;
    SG_NCCL_CHECK(ncclCommGetAsyncError(comm_->comm, &state));
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      result = state;
      break;
    }
    if (Clock::now() >= deadline) {
      ncclCommAbort(comm_->comm);
      comm_->aborted = true;
      throw ConsensusError("stepguard: rank " + std::to_string(rank_) +
                               ": NCCL communicator setup missed its deadline of " +
                               std::to_string(timeout_.count()) + " ms",
                           0, {});
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (comm_->comm) ncclCommAbort(comm_->comm);
  comm_->aborted = true;
  throw ConsensusError(
      std::string("stepguard: NCCL communicator setup failed: ") + ncclGetErrorString(result), 0,
      {});
}

NcclConsensus::~NcclConsensus() {
  if (comm_ && comm_->comm && !comm_->aborted) ncclCommDestroy(comm_->comm);
}

void NcclConsensus::do_all_reduce_sum(at::Tensor& buffer, std::int64_t step) {
  TORCH_CHECK(buffer.is_cuda() && buffer.get_device() == device_, "stepguard: step ", step,
              ": the NCCL consensus buffer must live on cuda:", device_, ", got ", buffer.device());
  TORCH_CHECK(!comm_->aborted, "stepguard: the NCCL communicator was aborted at an earlier step");
  cudaStream_t stream = nullptr;  // legacy default stream: ordered after torch's default stream
  auto fail = [&](const std::string& why) {
    ncclCommAbort(comm_->comm);
    comm_->aborted = true;
    std::ostringstream msg;
    msg << "stepguard: rank " << rank_ << ": the step " << step << " all-reduce over nccl ("
        << world_size_ << " ranks, deadline " << timeout_.count() << " ms) failed: " << why;
    throw ConsensusError(msg.str(), step, {});
  };
  const ncclResult_t launched = ncclAllReduce(buffer.data_ptr(), buffer.data_ptr(), buffer.numel(),
                                              ncclFloat64, ncclSum, comm_->comm, stream);
  if (launched != ncclSuccess && launched != ncclInProgress) fail(ncclGetErrorString(launched));
  const auto deadline = Clock::now() + timeout_;
  while (true) {
    const cudaError_t done = cudaStreamQuery(stream);
    if (done == cudaSuccess) return;
    if (done != cudaErrorNotReady) fail(cudaGetErrorString(done));
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm_->comm, &state);
    if (state != ncclSuccess && state != ncclInProgress) fail(ncclGetErrorString(state));
    if (Clock::now() >= deadline) fail("deadline passed (a rank is dead or stuck)");
    std::this_thread::yield();
  }
}

}  // namespace consensus
}  // namespace stepguard
