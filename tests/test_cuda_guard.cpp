// The guard and RAM snapshots on CUDA tensors, through LibTorch: built and linked whenever nvcc
// exists; run only where a GPU and a CUDA LibTorch are present. The inspection kernel alone is
// tested in test_cuda.cpp.
#if STEPGUARD_EXPECT_CUDA
#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <stepguard/stepguard.h>
#include <torch/torch.h>

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "csrc/checkpoint/snapshot.h"
#include "csrc/inspect/cuda/inspect_cuda.h"
#include "csrc/inspect/inspect.h"
#include "tests/support/skip_without_gpu.h"

namespace stepguard {
namespace {

// Streams through the device-generic c10 interface only (libc10): this file links against a
// CPU-only LibTorch too, where these tests skip.
c10::impl::VirtualGuardImpl cuda_impl() { return c10::impl::VirtualGuardImpl(c10::kCUDA); }

// A pool stream of cuda:0 (non-blocking, like every pool stream) that has waited for the default
// stream's work so far (the tensors the test made there).
c10::Stream pool_stream_after_default() {
  const c10::Device d(c10::kCUDA, 0);
  const c10::Stream pool = cuda_impl().getStreamFromGlobalPool(d);
  c10::Event made(c10::kCUDA);
  made.record(cuda_impl().getDefaultStream(d));
  made.block(pool);
  return pool;
}

template <typename S, typename = void>
struct HasNativeHandle : std::false_type {};
template <typename S>
struct HasNativeHandle<S, std::void_t<decltype(std::declval<const S&>().native_handle())>>
    : std::true_type {};

// Holds `stream` for `ms` milliseconds (a host function that sleeps), so work enqueued on it next
// is still pending when the code under test runs: work on the wrong stream would overtake it.
// Needs the cudaStream_t, which only a LibTorch with c10::Stream::native_handle() (2.11+) gives
// without c10_cuda; returns false (holds nothing) otherwise.
template <typename S>
bool hold_stream(const S& stream, int ms) {
  if constexpr (HasNativeHandle<S>::value) {
    static int hold_ms = 0;
    hold_ms = ms;
    const auto sleep = [](void*) {
      std::this_thread::sleep_for(std::chrono::milliseconds(hold_ms));
    };
    const c10::DeviceGuard on_device(stream.device());
    return cudaLaunchHostFunc(static_cast<cudaStream_t>(stream.native_handle()), sleep, nullptr) ==
           cudaSuccess;
  } else {
    (void)stream;
    (void)ms;
    return false;
  }
}
#define NOTE_IF_NOT_HELD(held)                                                                  \
  do {                                                                                          \
    if (!(held)) {                                                                              \
      std::cout << "[   NOTE   ] this LibTorch's c10::Stream has no native_handle() (< 2.11): " \
                   "the stream is not held, so the ordering is not exercised\n";                \
    }                                                                                           \
  } while (0)

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

// The optimizer state check's flag on the GPU: a negative element of a nonnegative tensor counts
// as NaN, per tensor and in total, as on the CPU.
TEST(CudaGuard, ANegativeSecondMomentCountsAsNaNAsOnTheCpu) {
  SKIP_WITHOUT_GPU();
  if (!torch::cuda::is_available()) GTEST_SKIP() << "this LibTorch was built without CUDA";
  at::manual_seed(6);
  std::vector<at::Tensor> cpu = {at::rand({300001}), at::randn({77}).to(at::kHalf),
                                 at::rand({5000}).to(at::kBFloat16), at::rand({9})};
  cpu[0][299999] = -1e-20f;
  cpu[3][2] = std::nanf("");
  inspect::InspectOptions options;
  options.nonnegative = {1, 1, 1, 0};
  options.table = 1;
  std::vector<at::Tensor> gpu;
  for (const auto& t : cpu) gpu.push_back(t.cuda());
  const LocalStats a = inspect::inspect_gradients(cpu, options);
  const LocalStats b = inspect::inspect_gradients(gpu, options);
  EXPECT_EQ(a.nan_count, b.nan_count);
  EXPECT_EQ(a.inf_count, b.inf_count);
  EXPECT_EQ(a.tensor_sum_squares, b.tensor_sum_squares);
  EXPECT_EQ(a.nonfinite_tensors, b.nonfinite_tensors);
  EXPECT_EQ(b.nonfinite_tensors, (std::vector<std::int64_t>{0, 1, 3}));  // randn fp16: negatives
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

// On a pool stream (non-blocking) held by earlier work: the inspection must run after that work,
// on that stream, with the same bits as the CPU pass, and leave the current stream and device.
TEST(CudaGuard, OnAPoolStreamTheInspectionRunsAfterThatStreamsWorkAndMatchesTheCpuPass) {
  SKIP_WITHOUT_GPU();
  if (!torch::cuda::is_available()) GTEST_SKIP() << "this LibTorch was built without CUDA";
  at::manual_seed(9);
  std::vector<at::Tensor> cpu = {at::randn({300001}), at::randn({77}).to(at::kHalf),
                                 at::randn({5000}).to(at::kBFloat16), at::Tensor(),
                                 at::randn({64, 48}).t()};  // non-contiguous
  std::vector<at::Tensor> gpu;
  for (const auto& t : cpu) gpu.push_back(t.defined() ? t.cuda() : t);
  const c10::Device d(c10::kCUDA, 0);
  const c10::Stream pool = pool_stream_after_default();
  const c10::StreamGuard on_pool(pool);
  const bool held = hold_stream(pool, 300);
  NOTE_IF_NOT_HELD(held);
  // Enqueued behind the hold: an inspection on any other stream would miss it.
  cpu[0][12345] = std::nanf("");
  gpu[0][12345] = std::nanf("");
  cpu[4][3][5] = INFINITY;
  gpu[4][3][5] = INFINITY;
  const LocalStats a = inspect::inspect_gradients(cpu);
  const LocalStats b = inspect::inspect_gradients(gpu);
  EXPECT_EQ(a.nan_count, 1);
  EXPECT_EQ(b.nan_count, a.nan_count);
  EXPECT_EQ(b.inf_count, a.inf_count);
  EXPECT_EQ(b.sum_squares, a.sum_squares);
  EXPECT_EQ(b.tensor_sum_squares, a.tensor_sum_squares);
  EXPECT_EQ(b.nonfinite_tensors, a.nonfinite_tensors);
  EXPECT_EQ(cuda_impl().getStream(d), pool);
  EXPECT_EQ(cuda_impl().getDevice(), d);

  // In-place unscale on the pool stream, again behind a hold: the gradients read back (on the
  // pool stream) are the CPU pass's.
  inspect::InspectOptions unscale;
  unscale.inv_scale = 1.0 / 1024.0;
  unscale.unscale_in_place = true;
  const bool held_again = hold_stream(pool, 300);
  NOTE_IF_NOT_HELD(held_again);
  for (auto& t : gpu) {
    if (t.defined()) t.mul_(2);
  }
  for (auto& t : cpu) {
    if (t.defined()) t.mul_(2);
  }
  const LocalStats c = inspect::inspect_gradients(cpu, unscale);
  const LocalStats g = inspect::inspect_gradients(gpu, unscale);
  EXPECT_EQ(g.sum_squares, c.sum_squares);
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    if (!cpu[i].defined()) continue;
    const at::Tensor back = gpu[i].cpu().contiguous();
    const at::Tensor want = cpu[i].contiguous();
    EXPECT_EQ(0, std::memcmp(back.data_ptr(), want.data_ptr(), want.nbytes())) << i;
  }
}

TEST(CudaGuard, TheCallersCurrentDeviceIsRestored) {
  SKIP_WITHOUT_GPU();
  if (!torch::cuda::is_available()) GTEST_SKIP() << "this LibTorch was built without CUDA";
  if (cuda::device_count() < 2) {
    GTEST_SKIP() << "needs 2 GPUs (gradients on cuda:0 while cuda:1 is current); with one, "
                    "nothing can change";
  }
  const std::vector<at::Tensor> gpu = {at::randn({100000}, at::Device(at::kCUDA, 0))};
  const c10::DeviceGuard on_1(c10::Device(c10::kCUDA, 1));
  const LocalStats r = inspect::inspect_gradients(gpu);
  EXPECT_GT(r.sum_squares, 0.0);
  EXPECT_EQ(cuda_impl().getDevice(), c10::Device(c10::kCUDA, 1));
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 1);
}

// Snapshots of CUDA tensors: pinned host copies, complete when take() returns (taken behind a
// hold on the current stream), the same bytes and checksum as a snapshot of CPU copies, and a
// full ring refills the same pinned buffers.
TEST(CudaSnapshot, CopiesArePinnedCompleteAndMatchACpuSnapshot) {
  SKIP_WITHOUT_GPU();
  if (!torch::cuda::is_available()) GTEST_SKIP() << "this LibTorch was built without CUDA";
  at::manual_seed(21);
  const auto on_gpu = at::TensorOptions().device(at::kCUDA, 0);
  std::vector<at::Tensor> live = {at::randn({257, 33}, on_gpu), at::randn({40, 64}, on_gpu).t(),
                                  at::randn({1001}, on_gpu).to(at::kHalf), at::empty({0}, on_gpu),
                                  at::randn({12})};  // the last on CPU
  const c10::Stream pool = pool_stream_after_default();
  const c10::StreamGuard on_pool(pool);
  checkpoint::SnapshotRing ring(1);
  const void* first_buffer = nullptr;
  for (std::int64_t step = 1; step <= 2; ++step) {
    const bool held = hold_stream(pool, 300);
    NOTE_IF_NOT_HELD(held);
    {
      at::NoGradGuard no_grad;
      for (auto& t : live) t.add_(1.0);  // behind the hold: a copy that overtook it misses this
    }
    std::vector<checkpoint::NamedTensor> named;
    for (std::size_t i = 0; i < live.size(); ++i)
      named.push_back({"t." + std::to_string(i), live[i]});
    ring.take(step, named, "opaque", {step});
    const checkpoint::Snapshot* s = ring.at(step);
    ASSERT_NE(s, nullptr);
    ASSERT_EQ(s->tensors.size(), live.size());
    std::vector<checkpoint::NamedTensor> on_cpu;
    for (std::size_t i = 0; i < live.size(); ++i) {
      const at::Tensor& copy = s->tensors[i].tensor;
      const at::Tensor want = live[i].cpu().contiguous();
      EXPECT_TRUE(copy.device().is_cpu()) << i;
      EXPECT_TRUE(copy.is_contiguous()) << i;
      if (live[i].is_cuda() && live[i].numel() > 0) EXPECT_TRUE(copy.is_pinned()) << i;
      ASSERT_EQ(copy.nbytes(), want.nbytes()) << i;
      EXPECT_EQ(0, std::memcmp(copy.data_ptr(), want.data_ptr(), want.nbytes())) << i;
      on_cpu.push_back({named[i].name, want});
    }
    EXPECT_TRUE(ring.intact(*s));
    checkpoint::SnapshotRing cpu_ring(1);
    cpu_ring.take(step, on_cpu, "opaque", {step});
    EXPECT_EQ(s->checksum, cpu_ring.at(step)->checksum);
    if (step == 1) {
      first_buffer = s->tensors[0].tensor.data_ptr();
    } else {
      EXPECT_EQ(s->tensors[0].tensor.data_ptr(), first_buffer);  // refilled, not reallocated
    }
  }
  EXPECT_EQ(cuda_impl().getStream(c10::Device(c10::kCUDA, 0)), pool);
}

}  // namespace
}  // namespace stepguard
#endif
