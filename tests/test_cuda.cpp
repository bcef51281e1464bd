// The CUDA path: built and linked whenever nvcc exists; run only where a GPU is present.
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if STEPGUARD_EXPECT_CUDA
#include <cuda_runtime_api.h>
#endif

#include "csrc/consensus/nccl_probe.h"
#include "csrc/inspect/cuda/inspect_cuda.h"
#include "csrc/inspect/inspect.h"

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
  // A zero comes with its reason, a count without one; where torch sees GPUs, the same number.
  EXPECT_EQ(n == 0, !why.empty()) << why;
  if (at::detail::getCUDAHooks().hasCUDA()) {
    EXPECT_EQ(n, at::detail::getCUDAHooks().getNumGPUs());
  }
}

// Gradients as raw bytes plus the same data as CPU tensors, for GPU-vs-CPU comparisons.
struct Case {
  std::vector<at::Tensor> tensors;
  std::vector<std::vector<std::uint8_t>> bytes;
  std::vector<inspect::GradDtype> dtypes;
  void add(const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    tensors.push_back(c.clone());
    const auto* p = static_cast<const std::uint8_t*>(c.data_ptr());
    bytes.emplace_back(p, p + c.numel() * c.element_size());
    dtypes.push_back(inspect::grad_dtype_of(c, 0));
  }
};

Case mixed_case() {
  at::manual_seed(11);
  Case k;
  auto big = at::randn({3 * inspect::kChunkElements + 777});
  big[0] = std::nanf("");
  big[inspect::kChunkElements] = INFINITY;
  big[big.numel() - 1] = -INFINITY;
  k.add(big);
  k.add(at::empty({0}));                      // empty
  k.add(at::full({1}, 1e30f));                // one huge element
  k.add(at::randn({1000003}).to(at::kHalf));  // odd size, fp16
  auto bf = at::randn({70001}).to(at::kBFloat16);
  bf[70000] = std::nanf("");
  k.add(bf);                              // bf16 with NaN in the tail
  k.add(at::randn({4097}, at::kDouble));  // fp64
  k.add(at::full({5}, 1e-40f));           // fp32 denormals
  return k;
}

void expect_gpu_equals_cpu(const Case& k, double inv_scale, bool unscale, std::size_t misalign) {
  const cuda::HostInspection gpu =
      cuda::inspect_host_on_device(k.bytes, k.dtypes, inv_scale, unscale, misalign);
  std::vector<at::Tensor> cpu_grads;
  for (const auto& t : k.tensors) cpu_grads.push_back(t.clone());
  inspect::InspectOptions opt;
  opt.inv_scale = inv_scale;
  opt.unscale_in_place = unscale;
  const LocalStats cpu = inspect::inspect_gradients(cpu_grads, opt);
  EXPECT_EQ(gpu.global.nan_count, cpu.nan_count);
  EXPECT_EQ(gpu.global.inf_count, cpu.inf_count);
  EXPECT_EQ(gpu.global.sum_squares, cpu.sum_squares);  // bitwise, same reduction order
  EXPECT_EQ(gpu.tensor_sum_squares, cpu.tensor_sum_squares);
  for (std::size_t i = 0; i < k.tensors.size(); ++i) {
    const bool flagged = std::find(cpu.nonfinite_tensors.begin(), cpu.nonfinite_tensors.end(),
                                   static_cast<std::int64_t>(i)) != cpu.nonfinite_tensors.end();
    EXPECT_EQ(gpu.tensor_nonfinite[i], flagged ? 1 : 0) << i;
    if (unscale) {
      const at::Tensor c = cpu_grads[i].contiguous();
      EXPECT_EQ(0, std::memcmp(gpu.unscaled[i].data(), c.data_ptr(), gpu.unscaled[i].size()))
          << "unscaled tensor " << i;
    }
  }
}

TEST(CudaKernel, MatchesTheCpuPassBitwise) {
  SKIP_WITHOUT_GPU();
  expect_gpu_equals_cpu(mixed_case(), 1.0, false, 0);
}

TEST(CudaKernel, MatchesTheCpuPassWithInvScaleAndInPlaceUnscale) {
  SKIP_WITHOUT_GPU();
  expect_gpu_equals_cpu(mixed_case(), 1.0 / 65536.0, true, 0);
}

TEST(CudaKernel, MisalignedTensorsTakeTheScalarPathWithTheSameResult) {
  SKIP_WITHOUT_GPU();
  // 8 bytes: every element stays naturally aligned (a misaligned scalar load is a sticky CUDA
  // error that would fail every later test), while 16-byte vector loads are defeated.
  expect_gpu_equals_cpu(mixed_case(), 1.0, false, 8);
  expect_gpu_equals_cpu(mixed_case(), 0.25, true, 24);
}

TEST(CudaKernel, EmptySetIsAllZero) {
  SKIP_WITHOUT_GPU();
  const cuda::HostInspection gpu = cuda::inspect_host_on_device({}, {});
  EXPECT_EQ(gpu.global.nan_count + gpu.global.inf_count, 0);
  EXPECT_EQ(gpu.global.sum_squares, 0.0);
}

#if STEPGUARD_EXPECT_CUDA
TEST(CudaKernel, OneLaunchPerCallAndTheTableIsBuiltOnce) {
  SKIP_WITHOUT_GPU();
  cuda::FusedInspector inspector(0);
  std::vector<float> host(300000, 1.0f);
  float* device = nullptr;
  double* global = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), host.size() * sizeof(float)),
            cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&global), 4 * sizeof(double)), cudaSuccess);
  cudaMemcpy(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice);
  const std::vector<cuda::DeviceGradient> grads = {
      {device, 100000, inspect::GradDtype::kFloat32},
      {device + 100000, 200000, inspect::GradDtype::kFloat32}};
  for (int i = 0; i < 5; ++i)
    inspector.inspect(grads, 1.0, false, {global, nullptr, nullptr}, nullptr);
  double g[4];
  cudaMemcpy(g, global, sizeof g, cudaMemcpyDeviceToHost);
  EXPECT_EQ(g[2], 300000.0);
  EXPECT_EQ(inspector.launches(), 5);
  EXPECT_EQ(inspector.table_builds(), 1);
  cudaFree(device);
  cudaFree(global);
}
#endif

TEST(CudaKernel, WithoutAGpuTheCallFailsWithAClearError) {
  std::string why;
  if (cuda::device_count(&why) > 0) GTEST_SKIP() << "a GPU is present";
  try {
    cuda::inspect_host_on_device({{0, 0, 128, 63}}, {inspect::GradDtype::kFloat32});
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("no CUDA device") != std::string::npos ||
                msg.find("built without CUDA") != std::string::npos)
        << msg;
  }
}

TEST(Nccl, OneRankAllReduceRuns) {
  SKIP_WITHOUT_GPU();
  std::string why;
  EXPECT_TRUE(consensus::nccl_self_test(&why)) << why;
}

}  // namespace
}  // namespace stepguard

#if STEPGUARD_EXPECT_CUDA
#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

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

#if STEPGUARD_EXPECT_CUDA
#include <stepguard/stepguard.h>
#include <torch/torch.h>

namespace stepguard {
namespace {

TEST(CudaGuard, CudaGradientsTakeTheFusedPathAndMatchTheCpuPassBitwise) {
  SKIP_WITHOUT_GPU();
  if (!torch::cuda::is_available()) GTEST_SKIP() << "this LibTorch was built without CUDA";
  at::manual_seed(5);
  std::vector<at::Tensor> cpu = {at::randn({300001}), at::randn({77}).to(at::kHalf),
                                 at::randn({5000}).to(at::kBFloat16), at::Tensor()};
  cpu[0][12345] = std::nanf("");
  std::vector<at::Tensor> gpu;
  for (const auto& t : cpu) gpu.push_back(t.defined() ? t.cuda() : t);
  const LocalStats a = inspect::inspect_gradients(cpu);
  const LocalStats b = inspect::inspect_gradients(gpu);
  EXPECT_EQ(a.sum_squares, b.sum_squares);
  EXPECT_EQ(a.tensor_sum_squares, b.tensor_sum_squares);
  EXPECT_EQ(a.nan_count, b.nan_count);
  EXPECT_EQ(a.nonfinite_tensors, b.nonfinite_tensors);
}

TEST(CudaGuard, ASkippedCudaStepLeavesParametersUnchanged) {
  SKIP_WITHOUT_GPU();
  if (!torch::cuda::is_available()) GTEST_SKIP() << "this LibTorch was built without CUDA";
  torch::nn::Linear model(8, 4);
  model->to(torch::kCUDA);
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(adamw, model->named_parameters());
  auto loss = model->forward(torch::ones({2, 8}, torch::kCUDA)).pow(2).sum();
  loss.backward();
  EXPECT_TRUE(guard.step(loss).applied());
  const auto before = model->weight.detach().clone();
  adamw.zero_grad();
  loss = model->forward(torch::ones({2, 8}, torch::kCUDA)).pow(2).sum();
  loss.backward();
  model->weight.mutable_grad()[1][2] = INFINITY;
  const StepReport r = guard.step(loss);
  EXPECT_EQ(r.outcome, Outcome::kSkipped);
  ASSERT_TRUE(r.incident.has_value());
  EXPECT_EQ(r.incident->tensors, std::vector<std::string>({"weight"}));
  EXPECT_TRUE(torch::equal(before, model->weight.detach()));
}

}  // namespace
}  // namespace stepguard
#endif
