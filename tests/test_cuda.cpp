// The CUDA path: built and linked whenever nvcc exists; run only where a GPU is present.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "csrc/consensus/nccl_probe.h"
#include "csrc/inspect/cuda/inspect_cuda.h"

namespace stepguard {
namespace {

#define SKIP_WITHOUT_GPU()                                                                 \
  do {                                                                                     \
    std::string why;                                                                       \
    if (cuda::device_count(&why) == 0) GTEST_SKIP() << "no CUDA GPU here (" << why << ")"; \
  } while (0)

TEST(CudaBuild, CompiledInExactlyWhenConfigured) {
  EXPECT_EQ(cuda::compiled_with_cuda(), STEPGUARD_EXPECT_CUDA != 0);
  if (cuda::compiled_with_cuda()) {
    // ncclGetVersion needs no GPU: proves NCCL is linked and loadable.
    EXPECT_GE(consensus::nccl_version(), 20000);
  } else {
    EXPECT_EQ(consensus::nccl_version(), 0);
  }
}

TEST(CudaBuild, DeviceCountNeverThrowsAndExplainsAZero) {
  std::string why;
  const int n = cuda::device_count(&why);
  EXPECT_GE(n, 0);
  if (n == 0) EXPECT_FALSE(why.empty());
}

TEST(CudaKernel, CountsNonFiniteAndSumsSquaresLikeTheCpuReference) {
  SKIP_WITHOUT_GPU();
  std::vector<float> host(100003, 0.5f);
  host[0] = std::numeric_limits<float>::quiet_NaN();
  host[5000] = std::numeric_limits<float>::infinity();
  host[100002] = -std::numeric_limits<float>::infinity();
  host[77] = 1e30f;
  const inspect::ChunkStats s = cuda::inspect_host_f32_on_device(host.data(), host.size());
  EXPECT_EQ(s.nan_count, 1);
  EXPECT_EQ(s.inf_count, 2);
  const double big = static_cast<double>(1e30f);
  const double expected = big * big + 0.25 * (host.size() - 4);
  EXPECT_NEAR(s.sum_squares, expected, 1e-12 * expected);
}

TEST(CudaKernel, EmptyBufferIsAllZero) {
  SKIP_WITHOUT_GPU();
  const inspect::ChunkStats s = cuda::inspect_host_f32_on_device(nullptr, 0);
  EXPECT_EQ(s.nan_count + s.inf_count, 0);
  EXPECT_EQ(s.sum_squares, 0.0);
}

TEST(Nccl, OneRankAllReduceRuns) {
  SKIP_WITHOUT_GPU();
  std::string why;
  EXPECT_TRUE(consensus::nccl_self_test(&why)) << why;
}

TEST(CudaKernel, WithoutAGpuTheCallFailsWithAClearError) {
  std::string why;
  if (cuda::device_count(&why) > 0) GTEST_SKIP() << "a GPU is present";
  const float x = 1.0f;
  try {
    cuda::inspect_host_f32_on_device(&x, 1);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("no CUDA device") != std::string::npos ||
                msg.find("built without CUDA") != std::string::npos)
        << msg;
  }
}

}  // namespace
}  // namespace stepguard

#if STEPGUARD_EXPECT_CUDA
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include "csrc/consensus/nccl_consensus.h"

namespace stepguard {
namespace {

TEST(NcclConsensus, OneRankAllReduceOfADeviceBufferWithinItsDeadline) {
  SKIP_WITHOUT_GPU();
  if (!torch::cuda::is_available()) GTEST_SKIP() << "this LibTorch was built without CUDA";
  auto store = c10::make_intrusive<c10d::HashStore>();
  consensus::NcclConsensus c(store, 0, 1, 0, std::chrono::seconds(30));
  EXPECT_STREQ(c.backend_name(), "nccl");
  auto buffer = at::arange(9, at::TensorOptions().dtype(at::kDouble).device(at::kCUDA, 0));
  c.all_reduce_sum(buffer, 1);
  EXPECT_TRUE(at::equal(buffer.cpu(), at::arange(9, at::kDouble)));
  EXPECT_EQ(c.collectives(), 1);
  auto host = at::zeros({3}, at::kDouble);
  EXPECT_THROW(c.all_reduce_sum(host, 2), c10::Error);  // wrong device: refused
}

}  // namespace
}  // namespace stepguard
#endif
