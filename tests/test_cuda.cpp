// The CUDA path: built and linked whenever nvcc exists; run only where a GPU is present. The
// build, the inspection kernel against the CPU pass, and NCCL; the guard and snapshots on CUDA
// tensors are in test_cuda_guard.cpp.
#include <ATen/core/grad_mode.h>
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
#include "tests/support/skip_without_gpu.h"

namespace stepguard {
namespace {

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

void expect_gpu_equals_cpu(const Case& k, double inv_scale, bool unscale, std::size_t misalign,
                           void* stream = nullptr) {
  const cuda::HostInspection gpu =
      cuda::inspect_host_on_device(k.bytes, k.dtypes, inv_scale, unscale, misalign, stream);
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

// More chunks than the last block stages at once (1024), with tensors that cross a tile edge,
// empty tensors between them and 2,000 one-chunk tensors: the parallel reduction keeps the
// CPU's order bit for bit.
TEST(CudaKernel, ManyChunksAndTensorsAcrossReductionTilesMatchTheCpuPass) {
  SKIP_WITHOUT_GPU();
  at::manual_seed(12);
  Case k;
  for (int t = 0; t < 2000; ++t) {
    if (t % 97 == 0) k.add(at::empty({0}));
    if (t == 1000) {
      // 40 chunks starting near chunk 1000: crosses the first tile edge.
      auto crossing = at::randn({40 * inspect::kChunkElements + 5});
      crossing[30 * inspect::kChunkElements] = std::nanf("");
      k.add(crossing);
    }
    k.add(at::randn({1 + (t * 37) % 3000}) * (1.0 + t % 7));
  }
  k.add(at::randn({4 * inspect::kChunkElements + 3}, at::kDouble));
  expect_gpu_equals_cpu(k, 1.0, false, 0);
  expect_gpu_equals_cpu(k, 0.5, true, 0);
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

// A stream created with cudaStreamNonBlocking (as every stream of PyTorch's pool is): the legacy
// default stream does not order against it, so everything must go to it.
struct NonBlockingStream {
  cudaStream_t stream = nullptr;
  NonBlockingStream() {
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  }
  ~NonBlockingStream() {
    if (stream) cudaStreamDestroy(stream);
  }
};

TEST(CudaKernel, MatchesTheCpuPassOnANonBlockingStream) {
  SKIP_WITHOUT_GPU();
  NonBlockingStream s;
  ASSERT_NE(s.stream, nullptr);
  expect_gpu_equals_cpu(mixed_case(), 1.0, false, 0, s.stream);
  expect_gpu_equals_cpu(mixed_case(), 1.0 / 65536.0, true, 0, s.stream);
}

TEST(CudaKernel, SteadyStateIsOneKernelOnTheCallersStreamAndCanBeCaptured) {
  SKIP_WITHOUT_GPU();
  NonBlockingStream s;
  ASSERT_NE(s.stream, nullptr);
  cuda::FusedInspector inspector(0);
  std::vector<float> host(300000, 1.0f);
  float* device = nullptr;
  double* global = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), host.size() * sizeof(float)),
            cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&global), 4 * sizeof(double)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  const std::vector<cuda::DeviceGradient> grads = {
      {device, 100000, inspect::GradDtype::kFloat32},
      {device + 100000, 200000, inspect::GradDtype::kFloat32}};
  const cuda::DeviceResults results{global, nullptr, nullptr};
  // Built eagerly on the stream; then a call is exactly one kernel on it. Global mode: any
  // legacy-stream or device-wide call (cudaMalloc, cudaMemcpy, ...) in inspect() fails the
  // capture.
  inspector.inspect(grads, 1.0, false, results, s.stream);
  ASSERT_EQ(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  inspector.inspect(grads, 1.0, false, results, s.stream);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s.stream, &graph), cudaSuccess);
  std::size_t nodes = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
  EXPECT_EQ(nodes, 1u);
  if (nodes == 1) {
    cudaGraphNode_t node = nullptr;
    cudaGraphNodeType type = cudaGraphNodeTypeEmpty;
    ASSERT_EQ(cudaGraphGetNodes(graph, &node, &nodes), cudaSuccess);
    ASSERT_EQ(cudaGraphNodeGetType(node, &type), cudaSuccess);
    EXPECT_EQ(type, cudaGraphNodeTypeKernel);
  }
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiateWithFlags(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(global, 0xff, 4 * sizeof(double), s.stream), cudaSuccess);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(cudaGraphLaunch(exec, s.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s.stream), cudaSuccess);
  double g[4];
  ASSERT_EQ(cudaMemcpy(g, global, sizeof g, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(g[0], 0.0);
  EXPECT_EQ(g[2], 300000.0);  // every replay reset the done counter for the next
  EXPECT_EQ(inspector.table_builds(), 1);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  // A rebuild while capturing is refused before anything is enqueued: the capture stays valid.
  const std::vector<cuda::DeviceGradient> other = {grads[1]};
  ASSERT_EQ(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  try {
    inspector.inspect(other, 1.0, false, results, s.stream);
    ADD_FAILURE() << "a rebuild during capture was not refused";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("captured"), std::string::npos) << e.what();
  }
  cudaGraph_t empty = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(s.stream, &empty), cudaSuccess);
  if (empty) cudaGraphDestroy(empty);
  // Eagerly, the same call rebuilds and runs.
  inspector.inspect(other, 1.0, false, results, s.stream);
  ASSERT_EQ(cudaStreamSynchronize(s.stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(g, global, sizeof g, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(g[2], 200000.0);
  EXPECT_EQ(inspector.table_builds(), 2);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cudaFree(device);
  cudaFree(global);
}

TEST(CudaKernel, TheCallersCurrentDeviceIsRestored) {
  SKIP_WITHOUT_GPU();
  if (cuda::device_count() < 2) {
    GTEST_SKIP() << "needs 2 GPUs (the inspection runs on device 0 while device 1 is current); "
                    "with one, nothing can change";
  }
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  {
    cuda::FusedInspector inspector(0);  // the constructor queries device 0
    int current = -1;
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 1);
  }
  expect_gpu_equals_cpu(mixed_case(), 1.0, false, 0);  // table, launch and copies on device 0
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
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
