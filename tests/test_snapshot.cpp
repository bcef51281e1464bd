// The RAM snapshot ring: host copies keyed by step that share nothing with the live tensors, a
// full ring refilling its oldest buffers, the newest K kept, a checksum that finds corruption,
// and exactly the steps the controller's book keeps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "csrc/checkpoint/snapshot.h"
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

}  // namespace
}  // namespace stepguard
