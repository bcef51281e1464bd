#include "csrc/consensus/nccl_consensus.h"

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#include "csrc/common/cuda_check.h"
#include "csrc/consensus/process_group_consensus.h"

// Non-blocking communicators, ncclCommInitRankConfig, ncclCommFinalize and ncclGetLastError all
// arrived by 2.14; nothing newer is used.
#if !defined(NCCL_VERSION_CODE) || !defined(NCCL_VERSION) || \
    NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "stepguard: NcclConsensus needs NCCL 2.14 or newer"
#endif

namespace stepguard {
namespace consensus {

namespace {
using Clock = std::chrono::steady_clock;

// How often the host looks: a step's small all-reduce finishes in microseconds, so polls start
// hot; a wait that lasts (a slow peer, a rendezvous) naps between polls instead of taking a core.
constexpr auto kSpinFor = std::chrono::milliseconds(2);
constexpr auto kStepNap = std::chrono::microseconds(100);
constexpr auto kSetupNap = std::chrono::milliseconds(1);

class Backoff {
 public:
  explicit Backoff(Clock::duration nap) : nap_(nap) {}
  void pause() const {
    if (Clock::now() - start_ < kSpinFor) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap_);
    }
  }

 private:
  Clock::time_point start_ = Clock::now();
  Clock::duration nap_;
};

// Every instance takes the next number, in construction order, whether or not it needs it for its
// key: ranks that construct the same instances in the same order derive the same keys.
std::string pick_store_key(std::string given) {
  static std::atomic<std::uint64_t> instances{0};
  const std::uint64_t n = instances.fetch_add(1);
  if (!given.empty()) return given;
  return "stepguard/nccl/" + std::to_string(n) + "/unique_id";
}

// Makes `device` current and puts the previous device back on every way out. Never throws; the
// caller checks error().
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) noexcept : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      previous_ = -1;
      (void)cudaGetLastError();
    }
    error_ = cudaSetDevice(device_);
    if (error_ != cudaSuccess) (void)cudaGetLastError();
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && previous_ != device_ && cudaSetDevice(previous_) != cudaSuccess) {
      (void)cudaGetLastError();
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t error() const noexcept { return error_; }

 private:
  int device_;
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

// Polls a non-blocking communicator until its state leaves ncclInProgress: its state then, or
// ncclInProgress when `deadline` passed first. Polls at least once.
ncclResult_t wait_for_comm(ncclComm_t comm, Clock::time_point deadline, Clock::duration nap) {
  const Backoff backoff(nap);
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t got = ncclCommGetAsyncError(comm, &state);
    if (got != ncclSuccess && got != ncclInProgress) return got;
    if (got == ncclSuccess && state != ncclInProgress) return state;
    if (Clock::now() >= deadline) return ncclInProgress;
    backoff.pause();
  }
}

// NCCL's name for `result` and, when it has one, its last error message (read before an abort,
// which frees the communicator).
std::string nccl_error_text(ncclResult_t result, ncclComm_t comm) {
  std::string text = ncclGetErrorString(result);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
  return text;
}

std::string cuda_error_text(const char* what, cudaError_t err) {
  return std::string(what) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
}
}  // namespace

// The communicator and the CUDA objects one step uses; torn down under a device guard however the
// instance ends (also when its constructor throws).
struct NcclConsensus::Comm {
  int rank = 0;
  int device = 0;
  std::chrono::milliseconds timeout{0};
  ncclComm_t comm = nullptr;      // null once aborted or destroyed
  bool aborted = false;           // aborted after a failure: later steps are refused
  cudaStream_t stream = nullptr;  // the dedicated stream the all-reduce runs on
  cudaEvent_t ready = nullptr;    // recorded on the caller's stream: the buffer is written
  cudaEvent_t done = nullptr;     // recorded on `stream` behind the all-reduce

  Comm() = default;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  void abort() noexcept {
    if (comm != nullptr) ncclCommAbort(comm);
    comm = nullptr;
    aborted = true;
  }

  ~Comm() {
    if (comm == nullptr && stream == nullptr && ready == nullptr && done == nullptr) return;
    const DeviceGuard guard(device);
    if (comm != nullptr) {
      // Finalize flushes this rank's side and waits for the communicator to be quiescent; only
      // then does destroy free it without blocking. A peer that never gets there costs the
      // timeout, then an abort.
      const auto deadline = Clock::now() + timeout;
      ncclResult_t result = ncclCommFinalize(comm);
      if (result == ncclSuccess || result == ncclInProgress) {
        result = wait_for_comm(comm, deadline, kSetupNap);
      }
      if (result == ncclSuccess) {
        ncclCommDestroy(comm);
      } else {
        if (result == ncclInProgress) {
          std::fprintf(stderr,
                       "stepguard: rank %d: finalizing the NCCL communicator missed its deadline "
                       "of %lld ms (a rank is gone or stuck); aborting it\n",
                       rank, static_cast<long long>(timeout.count()));
        } else {
          std::fprintf(stderr,
                       "stepguard: rank %d: finalizing the NCCL communicator failed (%s); "
                       "aborting it\n",
                       rank, ncclGetErrorString(result));
        }
        ncclCommAbort(comm);
      }
      comm = nullptr;
    }
    // Destroying a stream or event with work still queued is allowed: CUDA frees them after it.
    if (done != nullptr) cudaEventDestroy(done);
    if (ready != nullptr) cudaEventDestroy(ready);
    if (stream != nullptr) cudaStreamDestroy(stream);
    (void)cudaGetLastError();
  }
};

NcclConsensus::NcclConsensus(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                             int device, std::chrono::milliseconds timeout, std::string store_key,
                             StreamFn caller_stream)
    : comm_(std::make_unique<Comm>()),
      rank_(rank),
      world_size_(world_size),
      device_(device),
      timeout_(timeout),
      store_key_(pick_store_key(std::move(store_key))),
      caller_stream_(std::move(caller_stream)) {
  TORCH_CHECK(store, "stepguard: NcclConsensus needs a store to exchange the NCCL id");
  TORCH_CHECK(world_size > 0 && rank >= 0 && rank < world_size, "stepguard: rank ", rank,
              " is outside world size ", world_size);
  TORCH_CHECK(device >= 0, "stepguard: NcclConsensus needs a CUDA device index, got ", device);
  TORCH_CHECK(timeout.count() > 0, "stepguard: collective timeout must be positive");
  comm_->rank = rank_;
  comm_->device = device_;
  comm_->timeout = timeout_;

  const DeviceGuard guard(device_);
  TORCH_CHECK(guard.error() == cudaSuccess, "stepguard: rank ", rank_,
              ": cannot use cuda:", device_, ": ", cudaGetErrorString(guard.error()));
  // Local resources first: a rank that cannot have them fails before the others wait for it.
  SG_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_->stream, cudaStreamNonBlocking));
  SG_CUDA_CHECK(cudaEventCreateWithFlags(&comm_->ready, cudaEventDisableTiming));
  SG_CUDA_CHECK(cudaEventCreateWithFlags(&comm_->done, cudaEventDisableTiming));

  // The id, through the store. Store::wait(keys, timeout) bounds the wait without touching the
  // store's own timeout (torch 1.13 and 2.x alike); get() then finds the key present.
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (rank_ == 0) SG_NCCL_CHECK(ncclGetUniqueId(&id));
  std::vector<std::uint8_t> bytes;
  try {
    if (rank_ == 0) {
      const auto* p = reinterpret_cast<const std::uint8_t*>(&id);
      store->set(store_key_, std::vector<std::uint8_t>(p, p + sizeof id));
    } else {
      store->wait({store_key_}, timeout_);
      bytes = store->get(store_key_);
    }
  } catch (const std::exception& e) {
    std::string cause = e.what();
    if (const auto nl = cause.find('\n'); nl != std::string::npos) cause.resize(nl);
    throw ConsensusError("stepguard: rank " + std::to_string(rank_) +
                             ": exchanging the NCCL id under store key '" + store_key_ +
                             "' failed or missed its deadline of " +
                             std::to_string(timeout_.count()) + " ms (" + cause + ")",
                         0, {});
  }
  if (rank_ != 0) {
    TORCH_CHECK(bytes.size() == sizeof id, "stepguard: NCCL id under store key '", store_key_,
                "' has ", bytes.size(), " bytes, expected ", sizeof id);
    std::memcpy(&id, bytes.data(), sizeof id);
  }

  // Non-blocking init, so a rank that never arrives cannot hang this one: poll the state until it
  // leaves ncclInProgress.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  if (const char* env = std::getenv("NCCL_COMM_BLOCKING"); env != nullptr && env[0] == '1') {
    // NCCL lets this variable override the config.
    std::fprintf(stderr,
                 "stepguard: rank %d: NCCL_COMM_BLOCKING=1 makes the NCCL communicator blocking: "
                 "a missing rank can hang its setup and a step's enqueue past the deadline\n",
                 rank_);
  }
  const auto deadline = Clock::now() + timeout_;
  ncclResult_t result = ncclCommInitRankConfig(&comm_->comm, world_size_, id, rank_, &config);
  if (result == ncclSuccess || result == ncclInProgress) {
    result = comm_->comm != nullptr ? wait_for_comm(comm_->comm, deadline, kSetupNap)
                                    : ncclInternalError;
  }
  if (result == ncclSuccess) return;
  const std::string why = result == ncclInProgress
                              ? "missed its deadline of " + std::to_string(timeout_.count()) +
                                    " ms (a rank did not arrive or is stuck)"
                              : "failed: " + nccl_error_text(result, comm_->comm);
  comm_->abort();
  throw ConsensusError("stepguard: rank " + std::to_string(rank_) + ": NCCL communicator setup (" +
                           std::to_string(world_size_) + " ranks, store key '" + store_key_ +
                           "') " + why,
                       0, {});
}

// ~Comm finalizes (or aborts) the communicator and frees the stream and events.
NcclConsensus::~NcclConsensus() = default;

void NcclConsensus::do_all_reduce_sum(at::Tensor& buffer, std::int64_t step) {
  TORCH_CHECK(buffer.is_cuda() && buffer.get_device() == device_, "stepguard: step ", step,
              ": the NCCL consensus buffer must live on cuda:", device_, ", got ", buffer.device());
  TORCH_CHECK(!comm_->aborted && comm_->comm != nullptr, "stepguard: rank ", rank_,
              ": the NCCL communicator was aborted at an earlier step; step ", step, " cannot run");
  const auto deadline = Clock::now() + timeout_;
  Comm& c = *comm_;
  const DeviceGuard guard(device_);
  cudaStream_t caller = cudaStreamLegacy;  // torch's default stream
  bool stream_joined = false;  // the dedicated stream waits on `ready`: NCCL may have queued work
  bool caller_joined = false;  // the caller's stream waits on `done`

  auto fail = [&](const std::string& why) {
    c.abort();  // the kernel, if queued, sees the abort and exits, so `done` completes
    if (stream_joined && !caller_joined) {
      // Whatever reached the dedicated stream stays ordered before the caller's next use of the
      // buffer (and of memory the caching allocator hands out again on the caller's stream).
      if (cudaEventRecord(c.done, c.stream) == cudaSuccess) cudaStreamWaitEvent(caller, c.done, 0);
    }
    (void)cudaGetLastError();  // keep our error out of torch's next launch check
    std::ostringstream msg;
    msg << "stepguard: rank " << rank_ << ": the step " << step << " all-reduce over nccl ("
        << world_size_ << " ranks, deadline " << timeout_.count() << " ms) failed: " << why;
    throw ConsensusError(msg.str(), step, {});
  };

  if (guard.error() != cudaSuccess) fail(cuda_error_text("cudaSetDevice", guard.error()));
  if (caller_stream_) {
    try {
      caller = caller_stream_();
    } catch (const std::exception& e) {
      fail(std::string("the caller's stream function threw: ") + e.what());
    }
  }

  // 1. The dedicated stream starts after everything already queued on the caller's stream.
  cudaError_t err = cudaEventRecord(c.ready, caller);
  if (err != cudaSuccess) fail(cuda_error_text("cudaEventRecord on the caller's stream", err));
  err = cudaStreamWaitEvent(c.stream, c.ready, 0);
  if (err != cudaSuccess) fail(cuda_error_text("cudaStreamWaitEvent on the NCCL stream", err));
  stream_joined = true;

  // 2. Enqueue. A non-blocking communicator may answer ncclInProgress before anything is on the
  // stream (first use of a peer sets up its connections): poll until NCCL has really queued it.
  void* data = buffer.data_ptr();
  ncclResult_t result = ncclAllReduce(data, data, static_cast<std::size_t>(buffer.numel()),
                                      ncclFloat64, ncclSum, c.comm, c.stream);
  if (result == ncclSuccess || result == ncclInProgress) {
    result = wait_for_comm(c.comm, deadline, kStepNap);
  }
  if (result == ncclInProgress) {
    fail("NCCL did not get the all-reduce queued before the deadline (a rank is dead or stuck)");
  }
  if (result != ncclSuccess) fail(nccl_error_text(result, c.comm));

  // 3. Completion event behind the all-reduce; the caller's stream waits on it, so its later work
  // on the buffer (or on the buffer's memory, once freed) is ordered after the collective.
  err = cudaEventRecord(c.done, c.stream);
  if (err != cudaSuccess) fail(cuda_error_text("cudaEventRecord on the NCCL stream", err));
  err = cudaStreamWaitEvent(caller, c.done, 0);
  if (err != cudaSuccess) fail(cuda_error_text("cudaStreamWaitEvent on the caller's stream", err));
  caller_joined = true;

  // 4. The host waits for the event, watching NCCL's asynchronous state and the deadline.
  const Backoff backoff(kStepNap);
  while (true) {
    const cudaError_t done = cudaEventQuery(c.done);
    if (done == cudaSuccess) return;
    if (done != cudaErrorNotReady) fail(cuda_error_text("cudaEventQuery", done));
    (void)cudaGetLastError();  // not-ready is no error; do not leave it for torch to find
    ncclResult_t state = ncclSuccess;
    const ncclResult_t got = ncclCommGetAsyncError(c.comm, &state);
    if (got != ncclSuccess) fail(nccl_error_text(got, c.comm));
    if (state != ncclSuccess && state != ncclInProgress) fail(nccl_error_text(state, c.comm));
    if (Clock::now() >= deadline) fail("deadline passed (a rank is dead or stuck)");
    backoff.pause();
  }
}

}  // namespace consensus
}  // namespace stepguard
