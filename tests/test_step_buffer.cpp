// The per-step buffer: its layout, what a rank packs, and what unpacking the sum yields
// (agreed statistics, faulty ranks, the digest majority vote). Expected values by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "csrc/consensus/step_buffer.h"
#include "tests/support/op_count.h"

namespace stepguard {
namespace consensus {
namespace {

TEST(StepBuffer, TheSameFixedSizeAtEveryWorldSize) {
  // The gradients' block, 12 counts and figures, digest and fingerprint chunks, the fingerprint
  // count, the optimizer state check's block.
  EXPECT_EQ(step_slot::kSize, 2 * inspect_slot::kCount + 12 + 4 * step_slot::kChunks + 1);
  EXPECT_LE(StepBuffer::bytes(), 1024);
  for (int world : {1, 2, 4, 16, 16384}) {
    StepBuffer b(0, world, at::kCPU);
    EXPECT_EQ(b.tensor().numel(), step_slot::kSize) << world;
    EXPECT_EQ(b.tensor().numel() * 8, StepBuffer::bytes());
  }
  // The largest digest is an integer fp64 holds exactly.
  const double d = static_cast<double>(step_slot::kDigestMask);
  EXPECT_EQ(static_cast<std::uint64_t>(d), step_slot::kDigestMask);
  EXPECT_EQ(mask_digest(~std::uint64_t{0}), step_slot::kDigestMask);
}

TEST(StepBuffer, PacksTheLossCountsDigestChunksAndItsRow) {
  StepBuffer b(1, 3, at::kCPU);
  b.inspection_block().copy_(at::tensor({2.0, 0.0, 9.0, 0.0}, at::kDouble));
  const std::uint64_t digest = 0x0003000200010005ULL;
  LocalEvidence evidence;
  evidence.inputs_bad = true;
  b.pack(at::tensor(1.5f), digest, evidence);
  const at::Tensor t = b.tensor();
  ASSERT_EQ(t.numel(), step_slot::kSize);
  EXPECT_EQ(t[step_slot::kLossSum].item<double>(), 1.5);
  EXPECT_EQ(t[step_slot::kLossNonfinite].item<double>(), 0.0);
  EXPECT_EQ(t[step_slot::kRanksReporting].item<double>(), 1.0);
  EXPECT_EQ(t[step_slot::kFaultyRanks].item<double>(), 1.0);  // two NaN gradient elements
  EXPECT_EQ(t[step_slot::kInputRanks].item<double>(), 1.0);
  EXPECT_EQ(t[step_slot::kProbeRanks].item<double>(), 0.0);
  const double chunks[] = {5, 1, 2, 3};
  for (int c = 0; c < step_slot::kChunks; ++c) {
    EXPECT_EQ(t[step_slot::kDigest + c].item<double>(), chunks[c]);
    EXPECT_EQ(t[step_slot::kDigest + step_slot::kChunks + c].item<double>(), chunks[c] * chunks[c]);
  }
  EXPECT_EQ(t[step_slot::kFingerprintChecked].item<double>(), 0.0);
  EXPECT_EQ(t[step_slot::kCheckpointWritten].item<double>(), 1.0);  // none running
  const at::Tensor row = b.rank_row();
  EXPECT_EQ(row[row_slot::kGradFault].item<double>(), 1.0);
  EXPECT_EQ(row[row_slot::kLossBad].item<double>(), 0.0);
  EXPECT_EQ(row[row_slot::kInputsBad].item<double>(), 1.0);
  EXPECT_EQ(row[row_slot::kDigest].item<double>(), static_cast<double>(digest));
  EXPECT_EQ(row[row_slot::kFingerprint].item<double>(), 0.0);
}

TEST(StepBuffer, InputCountsJoinTheBufferOnTheDevice) {
  StepBuffer b(0, 2, at::kCPU);
  LocalEvidence evidence;
  evidence.inputs_counted = at::ones({}, at::kBool);
  b.pack(at::tensor(1.0), 1, evidence);
  EXPECT_EQ(b.tensor()[step_slot::kInputRanks].item<double>(), 1.0);
  EXPECT_EQ(b.rank_row()[row_slot::kInputsBad].item<double>(), 1.0);
  StepBuffer clean(1, 2, at::kCPU);
  evidence.inputs_counted = at::zeros({}, at::kBool);
  clean.pack(at::tensor(1.0), 1, evidence);
  EXPECT_EQ(clean.tensor()[step_slot::kInputRanks].item<double>(), 0.0);
  EXPECT_EQ(clean.rank_row()[row_slot::kInputsBad].item<double>(), 0.0);
}

// Three ranks' buffers and rows summed by hand, as the all-reduces would.
TEST(StepBuffer, AResetBufferPacksAsAFreshOneInTheSameStorage) {
  // The engine keeps one buffer for a guard's life: reset() then pack() must give what a new
  // buffer gives, in the same storage (no allocation per step).
  StepBuffer kept(1, 3, at::kCPU);
  kept.inspection_block().copy_(at::tensor({2.0, 1.0, 9.0, 0.0}, at::kDouble));
  LocalEvidence bad;
  bad.inputs_bad = true;
  bad.probe_bad = true;
  kept.pack(at::tensor(std::numeric_limits<double>::quiet_NaN()), 99, bad);
  const void* storage = kept.tensor().data_ptr();
  const void* row_storage = kept.rank_row().data_ptr();
  kept.reset();
  kept.pack(at::tensor(1.5), 5, LocalEvidence{});
  StepBuffer fresh(1, 3, at::kCPU);
  fresh.pack(at::tensor(1.5), 5, LocalEvidence{});
  EXPECT_TRUE(at::equal(kept.tensor(), fresh.tensor()));
  EXPECT_TRUE(at::equal(kept.rank_row(), fresh.rank_row()));
  EXPECT_EQ(kept.tensor().data_ptr(), storage);
  EXPECT_EQ(kept.rank_row().data_ptr(), row_storage);
}

TEST(StepBuffer, WhatTheHostKnowsIsWrittenInOneCopyNotAFillPerSlot) {
  // The loss given, the ranks reporting, the host's input and probe flags, the checkpoint state,
  // the digest's 8 chunk slots, the absent scales and the row's digest: values the host knows,
  // written from host memory in one copy for the buffer's slots and one for the row, not one
  // device op each. A step of a kept buffer (reset, then pack) made 41 ops that run a kernel
  // on the buffer's device (16 fills, 2 zeroings and a zeros_like among them); 21 now.
  StepBuffer b(0, 2, at::kCPU);
  LocalEvidence evidence;
  evidence.inputs_bad = true;
  const at::Tensor loss = at::tensor(2.5, at::kDouble);
  b.pack(loss, 7, evidence);  // the first step makes the host staging once
  const std::map<std::string, int> ops = ops_of([&] {
    b.reset();
    b.pack(loss, 0x0123456789abcdefull, evidence);
  });
  int kernels = 0;
  std::string listing;
  for (const auto& [name, n] : ops) {
    listing += name + " x" + std::to_string(n) + " ";
    // Views and no-op conversions launch nothing.
    for (const char* view : {"aten::select", "aten::narrow", "aten::reshape", "aten::detach",
                             "aten::to", "aten::empty"}) {
      if (name == view) kernels -= n;
    }
    kernels += n;
  }
  EXPECT_EQ(ops.count("aten::fill_"), 0u) << listing;
  EXPECT_EQ(ops.count("aten::empty"), 0u) << listing;  // no allocation on a kept buffer's step
  EXPECT_EQ(ops.at("aten::zero_"), 1) << listing;
  EXPECT_EQ(kernels, 21) << listing;
  // And the values are the ones the fills wrote.
  StepBuffer fresh(0, 2, at::kCPU);
  fresh.pack(loss, 0x0123456789abcdefull, evidence);
  EXPECT_TRUE(at::equal(b.tensor(), fresh.tensor()));
  EXPECT_TRUE(at::equal(b.rank_row(), fresh.rank_row()));
  const double* row = b.rank_row().data_ptr<double>();
  EXPECT_EQ(row[row_slot::kInputsBad], 1.0);
  EXPECT_EQ(row[row_slot::kDigest],
            static_cast<double>(0x0123456789abcdefull & step_slot::kDigestMask));
  EXPECT_EQ(b.tensor()[step_slot::kDigest + 1].item<double>(), static_cast<double>(0x89ab));
}

TEST(StepBuffer, TheDeviceSkipFlagAndItsHostReadingAgree) {
  // found_inf for the deferred verdict: 1.0f for a NaN/Inf gradient, a non-finite loss or a bad
  // optimizer state, 0.0f otherwise (an input or probe alone, the digest, decide nothing here).
  const auto flag = [](const std::function<void(StepBuffer&)>& fault) {
    StepBuffer b(0, 1, at::kCPU);
    fault(b);
    LocalEvidence evidence;
    evidence.inputs_bad = true;
    b.pack(at::tensor(2.0), 7, evidence);
    at::Tensor f;
    const std::map<std::string, int> ops = ops_of([&] { f = b.skip_flag(); });
    // sum, sum, add_, add_, sign_ (was clone, 4 add_, gt and a cast).
    int kernels = 0;
    for (const auto& [name, n] : ops)
      kernels += name == "aten::narrow" || name == "aten::select" ? 0 : n;
    EXPECT_EQ(kernels, 5);
    EXPECT_EQ(f.scalar_type(), at::kFloat);
    EXPECT_EQ(f.dim(), 0);
    EXPECT_EQ(f.item<float>() == 1.0f, StepBuffer::skips_on_device(b.tensor()));
    return f.item<float>();
  };
  EXPECT_EQ(flag([](StepBuffer&) {}), 0.0f);
  EXPECT_EQ(flag([](StepBuffer& b) { b.inspection_block()[inspect_slot::kNanCount].fill_(0.5); }),
            1.0f);  // one copy of a replicated NaN
  EXPECT_EQ(flag([](StepBuffer& b) { b.inspection_block()[inspect_slot::kInfCount].fill_(1); }),
            1.0f);
  EXPECT_EQ(flag([](StepBuffer& b) { b.state_block()[inspect_slot::kNanCount].fill_(1); }), 1.0f);
  EXPECT_EQ(flag([](StepBuffer& b) { b.state_block()[inspect_slot::kInfCount].fill_(2); }), 1.0f);
  StepBuffer nan_loss(0, 1, at::kCPU);
  nan_loss.pack(at::tensor(std::numeric_limits<double>::quiet_NaN()), 7, LocalEvidence{});
  EXPECT_EQ(nan_loss.skip_flag().item<float>(), 1.0f);
  EXPECT_TRUE(StepBuffer::skips_on_device(nan_loss.tensor()));
  // The host reading of a summed buffer unpacks as the buffer itself does.
  EXPECT_EQ(StepBuffer::unpack_host(nan_loss.tensor(), 1, 3).loss_nonfinite_ranks,
            nan_loss.unpack(3).loss_nonfinite_ranks);
  EXPECT_THROW(StepBuffer::unpack_host(at::zeros({3}, at::kDouble), 1, 3), c10::Error);
}

TEST(StepBuffer, UnpacksTheCountsAndTheRowsNameTheRanks) {
  at::Tensor sum;
  std::vector<double> rows;
  const double losses[] = {1.0, 3.0, NAN};
  const std::uint64_t digests[] = {7, 7, 8};
  for (int r = 0; r < 3; ++r) {
    StepBuffer b(r, 3, at::kCPU);
    // As inspect_counted_once() writes a gradient every rank holds: weighted by 1 / 3.
    b.inspection_block().copy_(
        at::tensor({0.0, r == 0 ? 1.0 / 3 : 0.0, 4.0 / 3, 0.0}, at::kDouble));
    b.pack(at::tensor(losses[r], at::kDouble), digests[r], LocalEvidence{});
    sum = r == 0 ? b.tensor().clone() : sum + b.tensor();
    for (int i = 0; i < row_slot::kSize; ++i) rows.push_back(b.rank_row()[i].item<double>());
  }
  StepBuffer agreed(0, 3, at::kCPU);
  agreed.tensor().copy_(sum);
  GlobalStats g = agreed.unpack(5);
  EXPECT_EQ(g.inf_count, 1);  // one copy's Inf: a third, rounded up
  EXPECT_EQ(g.loss_nonfinite_ranks, 1);
  EXPECT_EQ(g.loss, 2.0);                // mean of the finite losses
  EXPECT_DOUBLE_EQ(g.sum_squares, 4.0);  // replicated gradients count once
  EXPECT_DOUBLE_EQ(g.grad_norm, 2.0);
  EXPECT_EQ(g.faulty_rank_count, 2);
  EXPECT_EQ(g.checkpoint_written_ranks, 3);
  EXPECT_TRUE(g.state_differs);
  EXPECT_FALSE(g.replica_checked);
  EXPECT_TRUE(g.faulty_ranks.empty());  // not named before the rows are gathered
  ASSERT_TRUE(needs_rank_detail(g));
  fill_rank_detail(rows, 3, &g);
  EXPECT_EQ(g.faulty_ranks, std::vector<int>({0, 2}));
  EXPECT_EQ(g.desynced_ranks, std::vector<int>({2}));
  EXPECT_EQ(g.origin_ranks, std::vector<int>({2}));  // the NaN loss was rank 2's own
  ASSERT_EQ(g.rank_losses.size(), 3u);
  EXPECT_EQ(g.rank_losses[1], 3.0);
  EXPECT_TRUE(std::isnan(g.rank_losses[2]));
}

// The ranks a fault came from, packed by 3 ranks: `losses`, and each rank's gradient watch
// (`watched`: its gradients' sum before the framework's reduction, NaN when one held a NaN).
std::vector<int> origin_of(const std::vector<double>& losses, const std::vector<double>& watched) {
  at::Tensor sum;
  std::vector<double> rows;
  for (int r = 0; r < 3; ++r) {
    StepBuffer b(r, 3, at::kCPU);
    LocalEvidence evidence;
    evidence.watched_grad_sum =
        at::scalar_tensor(watched[static_cast<std::size_t>(r)], at::kDouble);
    b.pack(at::tensor(losses[static_cast<std::size_t>(r)], at::kDouble), 1, evidence);
    sum = r == 0 ? b.tensor().clone() : sum + b.tensor();
    for (int i = 0; i < row_slot::kSize; ++i) rows.push_back(b.rank_row()[i].item<double>());
  }
  StepBuffer agreed(0, 3, at::kCPU);
  agreed.tensor().copy_(sum);
  GlobalStats g = agreed.unpack(1);
  EXPECT_TRUE(needs_rank_detail(g));
  fill_rank_detail(rows, 3, &g);
  return g.origin_ranks;
}

// The gradient watch names the rank whose backward made a NaN when every loss is finite; a rank's
// own NaN loss comes first (under model parallelism the backward's collectives carry its NaN
// into its peers' gradients before their watch sees them).
TEST(StepBuffer, TheGradientWatchNamesTheOriginWhenNoLossDoes) {
  const double nan = std::nan("");
  EXPECT_EQ(origin_of({2.0, 2.0, 2.0}, {1.0, nan, 1.0}), std::vector<int>({1}));
  EXPECT_EQ(origin_of({2.0, nan, 2.0}, {nan, nan, 1.0}), std::vector<int>({1}));
  EXPECT_EQ(origin_of({2.0, 2.0, 2.0}, {nan, nan, nan}), std::vector<int>({0, 1, 2}));
}

// 3 ranks holding gradient shards: rank `nan_shard`'s shard holds one NaN after the reduction;
// `losses` as given; `unwatched`: no hook saw the gradients before their reduce-scatter (FSDP2).
GlobalStats named_over_shards(const std::vector<double>& losses, int nan_shard, bool unwatched) {
  at::Tensor sum;
  std::vector<double> rows;
  for (int r = 0; r < 3; ++r) {
    StepBuffer b(r, 3, at::kCPU);
    b.inspection_block().copy_(
        at::tensor({r == nan_shard ? 1.0 : 0.0, 0.0, 1.0, 0.0}, at::kDouble));
    b.pack(at::tensor(losses[static_cast<std::size_t>(r)], at::kDouble), 1, LocalEvidence{});
    sum = r == 0 ? b.tensor().clone() : sum + b.tensor();
    for (int i = 0; i < row_slot::kSize; ++i) rows.push_back(b.rank_row()[i].item<double>());
  }
  StepBuffer agreed(0, 3, at::kCPU);
  agreed.tensor().copy_(sum);
  GlobalStats g = agreed.unpack(1);
  g.shards_unwatched = unwatched;
  EXPECT_TRUE(needs_rank_detail(g));
  fill_rank_detail(rows, 3, &g);
  return g;
}

// Gradients reduced into shards before any hook saw them: a NaN one rank made lands in the shard
// of the rank owning those elements, so the shard's rank is not named as the origin (before, the
// owner was, and on-call went to a rank that did nothing). A rank's own evidence still names it.
TEST(StepBuffer, UnwatchedShardsLeaveTheOriginUnknownUnlessARankHasEvidenceOfItsOwn) {
  GlobalStats g = named_over_shards({2.0, 2.0, 2.0}, 0, true);
  EXPECT_EQ(g.faulty_ranks, std::vector<int>({0}));
  EXPECT_TRUE(g.origin_ranks.empty());
  EXPECT_TRUE(g.origin_unknown);
  g = named_over_shards({2.0, 2.0, std::nan("")}, 0, true);  // rank 2's own NaN loss
  EXPECT_EQ(g.origin_ranks, std::vector<int>({2}));
  EXPECT_FALSE(g.origin_unknown);
  g = named_over_shards({2.0, 2.0, 2.0}, 0, false);  // watched (ZeRO, Megatron): the owner made it
  EXPECT_EQ(g.origin_ranks, std::vector<int>({0}));
  EXPECT_FALSE(g.origin_unknown);
}

// Sums the buffers and rows of ranks with `losses` by hand; the agreed statistics, rows named.
GlobalStats agreed_losses(const std::vector<double>& losses) {
  at::Tensor sum;
  std::vector<double> rows;
  const int world = static_cast<int>(losses.size());
  for (int r = 0; r < world; ++r) {
    StepBuffer b(r, world, at::kCPU);
    b.pack(at::tensor(losses[static_cast<std::size_t>(r)], at::kDouble), 1, LocalEvidence{});
    sum = r == 0 ? b.tensor().clone() : sum + b.tensor();
    for (int i = 0; i < row_slot::kSize; ++i) rows.push_back(b.rank_row()[i].item<double>());
  }
  StepBuffer agreed(0, world, at::kCPU);
  agreed.tensor().copy_(sum);
  GlobalStats g = agreed.unpack(1);
  fill_rank_detail(rows, world, &g);
  return g;
}

// The sum of the squared losses bounds the largest rank loss (Samuelson), exactly when one rank
// stands out from ranks that agree: a one-rank spike is seen at any world size.
TEST(StepBuffer, TheLossSpreadBoundsTheLargestRankLoss) {
  std::vector<double> eight(8, 2.0);
  eight[5] = 20.0;
  GlobalStats g = agreed_losses(eight);
  EXPECT_DOUBLE_EQ(g.loss, 4.25);
  EXPECT_NEAR(g.loss_max_bound, 20.0, 1e-9);
  g = agreed_losses({2.0, 2.2, 1.9, 2.1});
  EXPECT_GE(g.loss_max_bound, 2.2);
  EXPECT_LT(g.loss_max_bound, 2.5);
  EXPECT_EQ(agreed_losses({3.0}).loss_max_bound, 3.0);
}

TEST(StepBuffer, AnInfLossOnEveryRankIsInfAndAMixIsNan) {
  const double inf = std::numeric_limits<double>::infinity();
  GlobalStats g = agreed_losses({inf, inf});
  EXPECT_EQ(g.loss_nonfinite_ranks, 2);
  EXPECT_EQ(g.loss, inf);
  EXPECT_TRUE(std::isnan(g.loss_max_bound));
  EXPECT_TRUE(std::isnan(agreed_losses({inf, NAN}).loss));
  EXPECT_EQ(agreed_losses({inf, 1.0}).loss, 1.0);  // the mean of the finite ones
}

TEST(StepBuffer, TheTensorsOfADivergedReplicaAreNamedByTheirOwnFingerprints) {
  const at::Tensor a = at::linspace(-1, 1, 6);
  const at::Tensor b = at::ones({2, 2});
  const at::Tensor drifted = a.clone();
  drifted[3] = drifted[3] * 1.5;
  std::vector<double> rows;
  for (const auto& params : {std::vector<at::Tensor>{a, b}, std::vector<at::Tensor>{a, b},
                             std::vector<at::Tensor>{drifted, b}}) {
    const at::Tensor f = tensor_fingerprints(params);
    ASSERT_EQ(f.numel(), 2);
    for (int i = 0; i < 2; ++i) rows.push_back(f[i].item<double>());
  }
  EXPECT_EQ(diverged_tensors(rows, 3, 2, {2}), (std::vector<std::size_t>{0}));
  EXPECT_TRUE(diverged_tensors(rows, 3, 2, {}).empty());
}

TEST(StepBuffer, ASpikeNamesTheRanksWhoseLossRose) {
  GlobalStats one = agreed_losses({2.0, 20.0, 2.1, 1.9});
  name_spike_ranks(2.0, &one);
  EXPECT_EQ(one.origin_ranks, std::vector<int>({1}));
  GlobalStats all = agreed_losses({19.0, 20.0, 22.0, 18.0});
  name_spike_ranks(2.0, &all);
  EXPECT_EQ(all.origin_ranks, std::vector<int>({0, 1, 2, 3}));
  GlobalStats none = agreed_losses({1.0, 1.5});
  name_spike_ranks(2.0, &none);
  EXPECT_TRUE(none.origin_ranks.empty());
}

// A rank still writing its disk checkpoint in the background keeps the count below the world
// size: nobody commits that checkpoint yet.
// Every rank of `world` packs the evidence `of(rank)` gives (loss 1, digest 1); the buffers are
// summed as the collective sums them and unpacked for `step`.
GlobalStats agreed_over(int world, std::int64_t step, const std::function<LocalEvidence(int)>& of) {
  at::Tensor sum;
  for (int r = 0; r < world; ++r) {
    StepBuffer b(r, world, at::kCPU);
    b.pack(at::tensor(1.0), 1, of(r));
    sum = r == 0 ? b.tensor().clone() : sum + b.tensor();
  }
  StepBuffer agreed(0, world, at::kCPU);
  agreed.tensor().copy_(sum);
  return agreed.unpack(step);
}

TEST(StepBuffer, RanksStillWritingACheckpointAreCounted) {
  const GlobalStats g = agreed_over(3, 4, [](int r) {
    LocalEvidence evidence;
    evidence.checkpoint_written = r != 1;
    return evidence;
  });
  EXPECT_EQ(g.checkpoint_written_ranks, 2);
  EXPECT_FALSE(needs_rank_detail(g));  // no incident: no second collective
}

// A framework scaler's scale and floor, device tensors of any dtype, arrive with the sums (their
// mean over the ranks); none given reads as 0.
TEST(StepBuffer, TheFrameworkScaleRidesInTheBuffer) {
  const GlobalStats g = agreed_over(2, 3, [](int) {
    LocalEvidence evidence;
    evidence.framework_scale = at::full({1}, 65536.0f);  // GradScaler's: float32, one element
    evidence.framework_floor = at::tensor(1.0f);
    return evidence;
  });
  EXPECT_EQ(g.framework_loss_scale, 65536.0);
  EXPECT_EQ(g.framework_min_scale, 1.0);
  StepBuffer none(0, 1, at::kCPU);
  none.pack(at::tensor(1.0), 1, LocalEvidence{});
  EXPECT_EQ(none.unpack(1).framework_loss_scale, 0.0);
}

// Any difference in any 16-bit chunk shows, including values whose sums agree.
TEST(StepBuffer, DigestsThatDifferAreSeenFromTheSumsAlone) {
  auto agreed = [](const std::vector<std::uint64_t>& digests) {
    at::Tensor sum;
    const int world = static_cast<int>(digests.size());
    for (int r = 0; r < world; ++r) {
      StepBuffer b(r, world, at::kCPU);
      b.pack(at::tensor(1.0), digests[static_cast<std::size_t>(r)], LocalEvidence{});
      sum = r == 0 ? b.tensor().clone() : sum + b.tensor();
    }
    StepBuffer out(0, world, at::kCPU);
    out.tensor().copy_(sum);
    return out.unpack(1);
  };
  EXPECT_FALSE(agreed({42, 42, 42, 42}).state_differs);
  EXPECT_FALSE(needs_rank_detail(agreed({~0ULL, ~0ULL})));
  EXPECT_TRUE(agreed({1, 3, 2, 2}).state_differs);  // the same sum, 8, as 2+2+2+2
  EXPECT_TRUE(agreed({1ULL << 63, 1ULL << 62}).state_differs);
  std::vector<std::uint64_t> many(16384, 0xDEADBEEFCAFEF00DULL);
  EXPECT_FALSE(agreed(many).state_differs);
  many[9000] ^= 1ULL << 40;
  EXPECT_TRUE(agreed(many).state_differs);
}

TEST(StepBuffer, TheFingerprintSeesAFiniteChangeOfOneElement) {
  std::vector<at::Tensor> params = {at::randn({64, 32}), at::randn({32}),
                                    at::randn({16}).to(at::kBFloat16), at::arange(4)};
  const std::int64_t base = parameter_fingerprint(params).item<std::int64_t>();
  EXPECT_EQ(parameter_fingerprint(params).item<std::int64_t>(), base);
  std::vector<at::Tensor> copy;
  for (const auto& p : params) copy.push_back(p.clone());
  EXPECT_EQ(parameter_fingerprint(copy).item<std::int64_t>(), base);
  copy[0][3][7] += 1e-3;
  EXPECT_NE(parameter_fingerprint(copy).item<std::int64_t>(), base);
  copy[0][3][7] -= 1e-3;
  copy[2][5] = 2.0;
  EXPECT_NE(parameter_fingerprint(copy).item<std::int64_t>(), base);
  // The same tensors in another order are another model.
  EXPECT_NE(parameter_fingerprint({params[1], params[0]}).item<std::int64_t>(),
            parameter_fingerprint({params[0], params[1]}).item<std::int64_t>());
}

TEST(StepBuffer, ADivergedReplicaIsNamedAsTheOrigin) {
  std::vector<at::Tensor> params = {at::randn({8, 8})};
  at::Tensor sum;
  std::vector<double> rows;
  for (int r = 0; r < 4; ++r) {
    std::vector<at::Tensor> mine = {params[0].clone()};
    if (r == 2) mine[0][1][1] += 0.5;
    StepBuffer b(r, 4, at::kCPU);
    b.pack(at::tensor(1.0), 9, LocalEvidence{}, parameter_fingerprint(mine));
    sum = r == 0 ? b.tensor().clone() : sum + b.tensor();
    for (int i = 0; i < row_slot::kSize; ++i) rows.push_back(b.rank_row()[i].item<double>());
  }
  StepBuffer agreed(0, 4, at::kCPU);
  agreed.tensor().copy_(sum);
  GlobalStats g = agreed.unpack(100);
  EXPECT_TRUE(g.replica_checked);
  EXPECT_TRUE(g.replica_differs);
  EXPECT_FALSE(g.state_differs);
  ASSERT_TRUE(needs_rank_detail(g));
  fill_rank_detail(rows, 4, &g);
  EXPECT_EQ(g.diverged_replicas, std::vector<int>({2}));
  EXPECT_EQ(g.origin_ranks, std::vector<int>({2}));
  EXPECT_TRUE(g.faulty_ranks.empty());
}

TEST(StepBuffer, AMissingRankIsAClearError) {
  StepBuffer b(0, 2, at::kCPU);
  b.pack(at::tensor(1.0), 1, LocalEvidence{});  // only this rank's contribution: 1 of 2
  try {
    b.unpack(9);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("step 9: 1 of 2 ranks reported statistics"), std::string::npos)
        << e.msg();
  }
}

}  // namespace
}  // namespace consensus
}  // namespace stepguard
