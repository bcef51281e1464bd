// NcclConsensus on real GPUs: built whenever CUDA and NCCL are, skipped where there is no GPU. A
// CPU-only LibTorch is enough: the step buffer is device memory seen as a CUDA tensor (the
// consensus reads only the tensor's metadata and pointer). Cases with several ranks need a GPU
// per rank, since NCCL refuses two ranks of one communicator on one device.
#include <gtest/gtest.h>

#if STEPGUARD_EXPECT_CUDA
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "csrc/consensus/nccl_consensus.h"
#include "csrc/consensus/process_group_consensus.h"
#include "csrc/inspect/cuda/inspect_cuda.h"

namespace stepguard {
namespace {

using consensus::ConsensusError;
using consensus::NcclConsensus;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

#define SKIP_UNLESS_GPUS(n)                                             \
  do {                                                                  \
    std::string why;                                                    \
    const int have = cuda::device_count(&why);                          \
    if (have < (n))                                                     \
      GTEST_SKIP() << "needs " << (n) << " CUDA GPUs, found " << have   \
                   << (why.empty() ? std::string() : " (" + why + ")"); \
  } while (0)

// float64 values in device memory, wrapped as a CUDA tensor without a CUDA LibTorch.
class DeviceBuffer {
 public:
  DeviceBuffer(int device, const std::vector<double>& values) : n_(values.size()) {
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&ptr_, n_ * sizeof(double)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr_, values.data(), n_ * sizeof(double), cudaMemcpyHostToDevice),
              cudaSuccess);
    const at::Device where(at::kCUDA, static_cast<c10::DeviceIndex>(device));
    tensor_ = at::for_blob(ptr_, {static_cast<std::int64_t>(n_)})
                  .deleter([](void*) {})
                  .target_device(where)
                  .options(at::TensorOptions().dtype(at::kDouble).device(where))
                  .make_tensor();
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  at::Tensor& tensor() { return tensor_; }
  void* data() { return ptr_; }
  std::vector<double> read() const {
    std::vector<double> host(n_);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, n_ * sizeof(double), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }

 private:
  std::size_t n_;
  void* ptr_ = nullptr;
  at::Tensor tensor_;
};

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

TEST(NcclConsensusGpu, OneRankSumsInPlaceAndLeavesTheStoreTimeoutAlone) {
  SKIP_UNLESS_GPUS(1);
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(7));
  NcclConsensus c(store, 0, 1, 0, std::chrono::seconds(30));
  EXPECT_EQ(store->getTimeout(), milliseconds(7000));
  EXPECT_TRUE(store->check({c.store_key()}));
  DeviceBuffer buffer(0, {1.5, -2.0, 3.25});
  for (std::int64_t step = 1; step <= 3; ++step) c.all_reduce_sum(buffer.tensor(), step);
  EXPECT_EQ(buffer.read(), (std::vector<double>{1.5, -2.0, 3.25}));
  EXPECT_EQ(c.collectives(), 3);
}

TEST(NcclConsensusGpu, TwoInstancesInOneProcessTakeDifferentStoreKeys) {
  SKIP_UNLESS_GPUS(1);
  auto store = c10::make_intrusive<c10d::HashStore>();
  NcclConsensus a(store, 0, 1, 0, std::chrono::seconds(30));
  NcclConsensus b(store, 0, 1, 0, std::chrono::seconds(30));
  NcclConsensus named(store, 0, 1, 0, std::chrono::seconds(30), "job7/stepguard_nccl_id");
  EXPECT_NE(a.store_key(), b.store_key());
  EXPECT_EQ(named.store_key(), "job7/stepguard_nccl_id");
  EXPECT_TRUE(store->check({"job7/stepguard_nccl_id"}));
  // The n-th instance of the process takes n, named or not: ranks agree by construction order.
  const auto number = [](const std::string& key) {
    return std::stoll(key.substr(std::string("stepguard/nccl/").size()));
  };
  EXPECT_EQ(number(b.store_key()), number(a.store_key()) + 1);
  DeviceBuffer x(0, {1.0}), y(0, {2.0});
  a.all_reduce_sum(x.tensor(), 1);
  b.all_reduce_sum(y.tensor(), 1);
  EXPECT_EQ(x.read(), std::vector<double>{1.0});
  EXPECT_EQ(y.read(), std::vector<double>{2.0});
}

// One rank sums to the buffer itself, so this cannot show the ordering; it shows the function is
// asked once per step and that events on a foreign non-blocking stream work.
TEST(NcclConsensusGpu, UsesTheCallersStreamFunctionOncePerStep) {
  SKIP_UNLESS_GPUS(1);
  std::vector<double> host(4096);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<double>(i % 97);
  DeviceBuffer buffer(0, std::vector<double>(host.size(), 0.0));
  cudaStream_t side = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  std::atomic<int> asked{0};
  auto store = c10::make_intrusive<c10d::HashStore>();
  NcclConsensus c(store, 0, 1, 0, std::chrono::seconds(30), {}, [&] {
    ++asked;
    return side;
  });
  ASSERT_EQ(cudaMemcpyAsync(buffer.data(), host.data(), host.size() * sizeof(double),
                            cudaMemcpyHostToDevice, side),
            cudaSuccess);
  c.all_reduce_sum(buffer.tensor(), 1);
  c.all_reduce_sum(buffer.tensor(), 2);
  EXPECT_EQ(asked.load(), 2);
  ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
  EXPECT_EQ(buffer.read(), host);
  cudaStreamDestroy(side);
}

TEST(NcclConsensusGpu, AMissingRankAtTheRendezvousFailsWithinTheDeadline) {
  SKIP_UNLESS_GPUS(1);
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(60));
  const auto start = Clock::now();
  try {
    NcclConsensus c(store, 1, 2, 0, milliseconds(1000), "never_published");
    FAIL() << "construction should have failed";
  } catch (const ConsensusError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("never_published"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(start), 10.0);
  EXPECT_EQ(store->getTimeout(), milliseconds(60000));
}

TEST(NcclConsensusGpu, AMissingRankAtNcclSetupIsAbortedAtTheDeadline) {
  SKIP_UNLESS_GPUS(1);
  auto store = c10::make_intrusive<c10d::HashStore>();
  int before = -1;
  ASSERT_EQ(cudaGetDevice(&before), cudaSuccess);
  const auto start = Clock::now();
  try {
    NcclConsensus c(store, 0, 2, 0, milliseconds(2000));  // rank 1 never comes
    FAIL() << "construction should have failed";
  } catch (const ConsensusError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("deadline"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(start), 15.0);  // 2 s deadline, then ncclCommAbort
  int after = -1;
  ASSERT_EQ(cudaGetDevice(&after), cudaSuccess);
  EXPECT_EQ(after, before);
}

TEST(NcclConsensusGpu, DestructionFinalizesWithinTheDeadline) {
  SKIP_UNLESS_GPUS(1);
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto c = std::make_unique<NcclConsensus>(store, 0, 1, 0, std::chrono::seconds(5));
  DeviceBuffer buffer(0, {4.0});
  c->all_reduce_sum(buffer.tensor(), 1);
  const auto start = Clock::now();
  c.reset();
  EXPECT_LT(seconds_since(start), 5.0);
}

TEST(NcclConsensusGpu, LeavesTheCallersCurrentDeviceAsItWas) {
  SKIP_UNLESS_GPUS(2);
  DeviceBuffer buffer(0, {1.0});
  auto store = c10::make_intrusive<c10d::HashStore>();
  int current = -1;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  {
    NcclConsensus c(store, 0, 1, 0, std::chrono::seconds(30));
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 1);  // after construction
    c.all_reduce_sum(buffer.tensor(), 1);
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 1);  // after a step
  }
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 1);  // after destruction
}

TEST(NcclConsensusGpu, TwoRanksOnTwoGpusAgreeStepAfterStep) {
  SKIP_UNLESS_GPUS(2);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::vector<double>> results(2);
  std::vector<std::string> errors(2);
  auto rank_main = [&](int rank) {
    try {
      // The first collective of a fresh communicator sets up its connections lazily: the path
      // where ncclAllReduce answers ncclInProgress before anything is queued.
      NcclConsensus c(store, rank, 2, rank, std::chrono::seconds(60));
      DeviceBuffer buffer(rank, {1.0 + rank, 10.0 * rank});
      for (std::int64_t step = 1; step <= 5; ++step) c.all_reduce_sum(buffer.tensor(), step);
      results[rank] = buffer.read();
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  };
  std::thread r0(rank_main, 0), r1(rank_main, 1);
  r0.join();
  r1.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  // Five sums of two ranks: (1 + 2) -> 3, 6, 12, 24, 48 and (0 + 10) -> 10, ..., 160.
  EXPECT_EQ(results[0], (std::vector<double>{48.0, 160.0}));
  EXPECT_EQ(results[1], results[0]);
}

TEST(NcclConsensusGpu, ADeadPeerFailsTheStepWithinTheDeadlineAndNamesIt) {
  SKIP_UNLESS_GPUS(2);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::string error0;
  std::int64_t failed_step = -1;
  bool refused_after = false;
  double waited = 0;
  auto rank0 = [&] {
    NcclConsensus c(store, 0, 2, 0, milliseconds(3000));
    DeviceBuffer buffer(0, {1.0});
    c.all_reduce_sum(buffer.tensor(), 1);
    const auto start = Clock::now();
    try {
      c.all_reduce_sum(buffer.tensor(), 2);  // rank 1 is gone
    } catch (const ConsensusError& e) {
      error0 = e.what();
      failed_step = e.step();
    }
    waited = seconds_since(start);
    try {
      c.all_reduce_sum(buffer.tensor(), 3);
    } catch (const c10::Error&) {
      refused_after = true;
    }
  };
  auto rank1 = [&] {
    NcclConsensus c(store, 1, 2, 1, milliseconds(3000));
    DeviceBuffer buffer(1, {2.0});
    c.all_reduce_sum(buffer.tensor(), 1);
    // Leaves after step 1: its destructor finalizes, or aborts when rank 0 does not follow.
  };
  std::thread t0(rank0), t1(rank1);
  t0.join();
  t1.join();
  EXPECT_EQ(failed_step, 2);
  EXPECT_NE(error0.find("rank 0"), std::string::npos) << error0;
  EXPECT_NE(error0.find("step 2"), std::string::npos) << error0;
  EXPECT_LT(waited, 13.0);
  EXPECT_TRUE(refused_after);
}

}  // namespace
}  // namespace stepguard
#endif
