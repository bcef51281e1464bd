// The RAM snapshot ring: host copies keyed by step that share nothing with the live tensors, a
// full ring refilling its oldest buffers, the newest K kept, a checksum that finds corruption,
// and exactly the steps the controller's book keeps. Copies run in the background: begin_take()
// returns before the copy does, a failed copy leaves the ring consistent, and a snapshot a disk
// write holds is never refilled. A hook holds a copy in flight: nothing here depends on timing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <new>
#include <string>

#include "csrc/checkpoint/rng_state.h"
#include "csrc/checkpoint/snapshot.h"
#include "tests/support/gate.h"
#include "tests/support/model_fixture.h"

namespace stepguard {
namespace {

using checkpoint::NamedTensor;

std::vector<NamedTensor> named(const std::vector<torch::Tensor>& ts) {
  std::vector<NamedTensor> out;
  for (std::size_t i = 0; i < ts.size(); ++i) out.push_back({"t." + std::to_string(i), ts[i]});
  return out;
}

TEST(Snapshot, CopiesShareNothingWithTheLiveTensors) {
  auto model = make_model(4);
  const auto params = model->parameters();
  checkpoint::SnapshotRing ring(1);
  ring.take(1, named(params), "opaque", {1, 2});
  const auto at_1 = clone_all(params);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.add_(1.0f);
  }
  const checkpoint::Snapshot* s = ring.at(1);
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->tensors.size(), at_1.size());
  for (std::size_t i = 0; i < at_1.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(s->tensors[i].tensor, at_1[i])) << i;
  }
  EXPECT_EQ(s->opaque, "opaque");
  EXPECT_EQ(s->guard, std::vector<std::int64_t>({1, 2}));
  EXPECT_FALSE(s->rng.empty());
  EXPECT_TRUE(ring.intact(*s));
}

TEST(Snapshot, AFullRingRefillsItsOldestBuffersInsteadOfAllocating) {
  auto model = make_model(11);
  const auto params = model->parameters();
  checkpoint::SnapshotRing ring(1);
  ring.take(1, named(params), "", {});
  const void* first = ring.at(1)->tensors[0].tensor.data_ptr();
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.mul_(2.0f);
  }
  ring.take(2, named(params), "", {});
  const checkpoint::Snapshot* s = ring.at(2);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(ring.at(1), nullptr);
  EXPECT_EQ(s->tensors[0].tensor.data_ptr(), first);
  // And it holds step 2's values.
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(s->tensors[i].tensor, params[i])) << i;
  }
}

TEST(Snapshot, RingKeepsTheNewestKAndTheStepsItIsTold) {
  auto model = make_model(6);
  checkpoint::SnapshotRing ring(2);
  for (std::int64_t step : {2, 4, 6}) ring.take(step, named(model->parameters()), "", {});
  EXPECT_EQ(ring.size(), 2u);
  EXPECT_EQ(ring.at(2), nullptr);
  EXPECT_GT(ring.bytes(), 0);
  ring.keep_only({4});
  EXPECT_EQ(ring.size(), 1u);
  EXPECT_NE(ring.at(4), nullptr);
  ring.drop(4);
  EXPECT_EQ(ring.size(), 0u);
}

TEST(Snapshot, TheChecksumFindsACorruptedCopy) {
  auto model = make_model(12);
  checkpoint::SnapshotRing ring(2);
  ring.take(1, named(model->parameters()), "state", {});
  auto* s = const_cast<checkpoint::Snapshot*>(ring.at(1));
  EXPECT_TRUE(ring.intact(*s));
  s->tensors[1].tensor.view(-1)[3].add_(1.0f);
  EXPECT_FALSE(ring.intact(*s));
  ring.take(2, named(model->parameters()), "state", {});
  auto* t = const_cast<checkpoint::Snapshot*>(ring.at(2));
  EXPECT_TRUE(ring.intact(*t));
  t->opaque[0] = 'X';
  EXPECT_FALSE(ring.intact(*t));
}

TEST(Snapshot, BeginTakeReturnsBeforeTheCopyAndTheSnapshotLandsAtFinish) {
  auto model = make_model(14);
  const auto params = model->parameters();
  const auto at_3 = clone_all(params);
  checkpoint::SnapshotRing ring(2);
  Gate gate(&checkpoint::set_copy_hook_for_testing);
  ring.begin_take(3, named(params), "bytes", {7});
  // Back on this thread while the copy has not even started: held, not in the ring yet.
  EXPECT_EQ(gate.held(), 3);
  EXPECT_FALSE(ring.in_flight().finished());
  EXPECT_EQ(ring.in_flight().step(), 3);
  EXPECT_EQ(ring.at(3), nullptr);
  EXPECT_EQ(ring.size(), 0u);
  gate.open();
  ring.finish_take();
  EXPECT_FALSE(ring.in_flight().valid());
  const checkpoint::Snapshot* s = ring.at(3);
  ASSERT_NE(s, nullptr);
  for (std::size_t i = 0; i < at_3.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(s->tensors[i].tensor, at_3[i])) << i;
  }
  EXPECT_EQ(s->opaque, "bytes");
  EXPECT_TRUE(ring.intact(*s));
}

// A copy that fails in the background (here: out of host memory) surfaces at finish_take(); the
// ring holds the snapshots it held, less the oldest whose buffers were being refilled, and takes
// the next snapshot normally.
TEST(Snapshot, AFailedBackgroundCopyLeavesTheRingConsistent) {
  auto model = make_model(15);
  checkpoint::SnapshotRing ring(2);
  ring.take(1, named(model->parameters()), "", {});
  ring.take(2, named(model->parameters()), "", {});
  {
    Gate gate(&checkpoint::set_copy_hook_for_testing);
    ring.begin_take(3, named(model->parameters()), "", {});
    EXPECT_EQ(gate.held(), 3);
    gate.open(/*fail=*/true);
    EXPECT_THROW(ring.finish_take(), std::bad_alloc);
  }
  EXPECT_FALSE(ring.in_flight().valid());
  EXPECT_EQ(ring.size(), 1u);
  EXPECT_EQ(ring.at(1), nullptr);  // given up for its buffers
  ASSERT_NE(ring.at(2), nullptr);
  EXPECT_TRUE(ring.intact(*ring.at(2)));
  EXPECT_EQ(ring.at(3), nullptr);
  ring.take(4, named(model->parameters()), "", {});
  EXPECT_EQ(ring.size(), 2u);
  EXPECT_NE(ring.at(4), nullptr);
}

// A disk write holds a snapshot (copy_of) while the ring moves on: the ring allocates new buffers
// instead of refilling the held ones, and the held copy keeps its step's values.
TEST(Snapshot, ASnapshotADiskWriteHoldsIsNeverRefilled) {
  auto model = make_model(16);
  const auto params = model->parameters();
  checkpoint::SnapshotRing ring(1);
  ring.take(1, named(params), "", {});
  const auto at_1 = clone_all(params);
  const checkpoint::SnapshotCopy held = ring.copy_of(1);
  ASSERT_TRUE(held.valid());
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.mul_(3.0f);
  }
  ring.take(2, named(params), "", {});
  EXPECT_EQ(ring.at(1), nullptr);
  const auto one = held.get();
  EXPECT_NE(ring.at(2)->tensors[0].tensor.data_ptr(), one->tensors[0].tensor.data_ptr());
  for (std::size_t i = 0; i < at_1.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(one->tensors[i].tensor, at_1[i])) << i;
    EXPECT_TRUE(bitwise_equal(ring.at(2)->tensors[i].tensor, params[i])) << i;
  }
  // The copy in flight is shared the same way, and the book can let go of it before it lands.
  Gate gate(&checkpoint::set_copy_hook_for_testing);
  ring.begin_take(3, named(params), "", {});
  const checkpoint::SnapshotCopy flying = ring.copy_of(3);
  EXPECT_EQ(flying.step(), 3);
  ring.keep_only({2});
  gate.open();
  ring.finish_take();
  EXPECT_EQ(ring.at(3), nullptr);
  EXPECT_EQ(flying.get()->step, 3);  // the write still has its copy
}

// A CPU generator state of the right size that torch refuses (mt19937 with `left` 0: what a
// crafted checkpoint with a recomputed checksum can hold) is found before anything is loaded,
// on a scratch generator: training's stream is untouched.
TEST(RngState, AStateTorchWouldRefuseIsFoundOnAScratchGenerator) {
  checkpoint::RngState state = checkpoint::capture_rng();
  checkpoint::check_rng(state);  // a real one passes
  state.cpu = state.cpu.clone();
  state.cpu.narrow(0, 8, 4).zero_();  // the_initial_seed (8 bytes), then left (int)
  const at::Tensor before = checkpoint::capture_rng().cpu;
  try {
    checkpoint::check_rng(state);
    ADD_FAILURE() << "an invalid mt19937 state passed";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("its CPU random-generator state is refused by torch"), std::string::npos)
        << e.msg();
  }
  EXPECT_TRUE(at::equal(checkpoint::capture_rng().cpu, before));
}

}  // namespace
}  // namespace stepguard
