// Root-cause classification: one hand-built piece of evidence per rule, in the debugging order
// (reproduces? data, weights, precision, learning rate, forward, backward).
#include <gtest/gtest.h>

#include <cmath>

#include "csrc/forensics/classifier.h"
#include "csrc/forensics/report.h"

namespace stepguard {
namespace forensics {
namespace {

Evidence nan_grads() {
  Evidence e;
  e.grads_nonfinite = true;
  e.nan_count = 3;
  e.blamed_grads = {"head.weight", "blocks.1.qkv.weight"};
  e.recent_grad_norms = {1.0, 1.1, 0.9};
  e.recent_losses = {2.0, 2.1, 1.9};
  e.grad_norm = 1.0;
  e.loss = 2.0;
  return e;
}

TEST(Classifier, ABatchThatIsFineOnReplayIsAHardwareSuspect) {
  Evidence e = nan_grads();
  e.rerun = ReplayResult::kVanished;
  e.bad_inputs = {"input 0 holds 3 NaN values"};  // the rerun decides first
  const Diagnosis d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "hardware_suspect");
  EXPECT_EQ(d.evidence[0].rfind("the same batch from the same state gave a finite result", 0), 0u);
  EXPECT_FALSE(d.fixes.empty());
}

TEST(Classifier, BadInputsAreData) {
  Evidence e = nan_grads();
  e.loss_nonfinite = true;
  e.rerun = ReplayResult::kReproduced;
  e.bad_inputs = {"input 0 holds 64 NaN/Inf values", "2 of 32 sequences are empty"};
  e.nonfinite_params = {"head.weight"};  // data comes before weights
  const Diagnosis d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "data");
  EXPECT_EQ(d.evidence, std::vector<std::string>({"the batch itself is bad: input 0 holds 64 "
                                                  "NaN/Inf values, 2 of 32 sequences are empty"}));
}

TEST(Classifier, BrokenWeightsAreForward) {
  Evidence e = nan_grads();
  e.loss_nonfinite = true;
  e.nonfinite_params = {"blocks.0.qkv.weight"};
  const Diagnosis d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "forward");
  EXPECT_EQ(d.evidence[0], "parameters hold NaN/Inf before the step: blocks.0.qkv.weight");
}

TEST(Classifier, FiniteInFp32UnderLossScalingIsPrecisionOverflow) {
  Evidence e = nan_grads();
  e.loss_scaling = true;
  e.loss_scale = 65536;
  e.rerun = ReplayResult::kReproduced;
  e.fp32 = ReplayResult::kVanished;
  const Diagnosis d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "precision_overflow");
  EXPECT_EQ(d.evidence[0],
            "the batch is finite when replayed in fp32; with fp16 and loss scale 65536 it "
            "overflowed");
  // Still non-finite in fp32: not a precision problem.
  e.fp32 = ReplayResult::kReproduced;
  EXPECT_STREQ(to_string(classify(e).cause), "backward");
}

TEST(Classifier, InfOnlyWithAFiniteLossUnderScalingIsPrecisionOverflowWithoutReplay) {
  Evidence e = nan_grads();
  e.nan_count = 0;
  e.inf_count = 12;
  e.loss_scaling = true;
  e.loss_scale = 1024;
  EXPECT_STREQ(to_string(classify(e).cause), "precision_overflow");
  e.loss_scaling = false;
  EXPECT_STREQ(to_string(classify(e).cause), "backward");
}

// Real fp16 overflow: thousands of Inf, a few NaN where Inf met Inf. Every step of the streak is
// an overflow, replayed or not; at the floor it says the scale cannot help; an fp32 replay that
// reproduced it earlier in the streak rules it out.
TEST(Classifier, InfWithAFewNanIsStillAnOverflowOnEveryStepOfTheStreak) {
  Evidence e = nan_grads();
  e.nan_count = 44;
  e.inf_count = 24194;
  e.loss_scaling = true;
  e.loss_scale = 32768;
  Diagnosis d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "precision_overflow");
  EXPECT_EQ(d.evidence[0],
            "Inf in the gradients (24194 Inf, 44 NaN where Inf met Inf) of a finite loss under "
            "loss scale 32768: an fp16 overflow");
  EXPECT_EQ(d.fixes[0], "nothing, if it stops within a few steps: the scale finds its level");
  e.loss_scale_at_floor = true;
  d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "precision_overflow");
  EXPECT_EQ(d.evidence[1], "the loss scale is at its floor: it cannot back off any further");
  EXPECT_EQ(d.fixes[0], "use bf16 instead of fp16");
  e.overflow_ruled_out = true;
  EXPECT_STREQ(to_string(classify(e).cause), "backward");
}

TEST(Classifier, OneRanksLossSpikeIsThatRanksBatch) {
  Evidence e;
  e.loss_spike = true;
  e.loss = 11.0;
  e.loss_level = 2.0;
  e.rank_losses = {2.0, 20.0};
  e.spike_ranks = {1};
  const Diagnosis d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "data");
  EXPECT_EQ(d.evidence[0],
            "the loss spiked on rank 1 only (20 there, 2 on the other ranks, 2 before): one bad "
            "batch, not the training");
  EXPECT_EQ(d.fixes[0].rfind("skip that batch and inspect it", 0), 0u);
  e.spike_ranks = {0, 1};  // every rank: the training
  EXPECT_STREQ(to_string(classify(e).cause), "divergence");
}

TEST(Classifier, ADivergenceThatOutlivedTheCutsIsTheLearningRate) {
  Evidence e;
  e.loss_not_recovered = true;
  e.loss = 2.7;
  e.loss_level = 0.36;
  e.grad_norm = 10.0;
  e.grad_norm_level = 1.0;
  e.diverging_steps = 60;
  e.escalations = 2;
  Diagnosis d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "divergence");
  EXPECT_EQ(d.evidence[0],
            "the loss is 2.7 60 steps after the spike, against 0.36 before it: it has not come "
            "back (raised 2 times)");
  EXPECT_EQ(d.evidence[1], "learning rate too high (the grad norm grew 10x over 60 steps)");
  EXPECT_EQ(d.fixes[1], "lengthen the warm-up");
  // A spike again after a rollback and a cut says the same.
  e.loss_not_recovered = false;
  e.loss_spike = true;
  d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "divergence");
  EXPECT_EQ(d.evidence[1], "learning rate too high (the grad norm grew 10x over 60 steps)");
}

TEST(Classifier, LossOrGradNormBlowUpIsDivergence) {
  Evidence e;
  e.loss_spike = true;
  e.loss = 57.0;
  e.recent_losses = {2.5, 2.4, 2.6};
  e.recent_grad_norms = {0.8, 0.9, 0.7};
  e.grad_norm = 35.0;
  Diagnosis d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "divergence");
  EXPECT_EQ(d.evidence[0], "the loss jumped to 57 (typical 2.5)");
  // A grad norm 100x its median, with no detector configured, is divergence too.
  Evidence g;
  g.recent_grad_norms = {1.0, 1.0, 2.0};
  g.grad_norm = 150.0;
  d = classify(g);
  EXPECT_STREQ(to_string(d.cause), "divergence");
  EXPECT_EQ(d.evidence[0], "the grad norm rose to 150 (typical 1)");
}

// One step's grad norm above its running statistics, the loss where it was: one batch's
// gradient, never "divergence" (a healthy run's small batches and data-shard changes do this).
TEST(Classifier, ALoneGradNormSpikeIsNotDivergence) {
  Evidence e;
  e.grad_norm_spike = true;
  e.grad_norm = 2.15;
  e.recent_grad_norms = {1.2, 1.25, 1.3};
  e.loss = 2.7;
  e.recent_losses = {2.6, 2.7, 2.8};
  Diagnosis d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "unknown");
  ASSERT_EQ(d.evidence.size(), 1u);
  EXPECT_NE(d.evidence[0].find("not a divergence"), std::string::npos) << d.evidence[0];
  EXPECT_NE(d.evidence[0].find("the grad norm rose to 2.15 (typical 1.25)"), std::string::npos);
  // With the loss spiking too it is divergence, as before.
  e.loss_spike = true;
  e.loss = 27.0;
  EXPECT_STREQ(to_string(classify(e).cause), "divergence");
}

// The evidence says what was looked at: the weights always, the inputs only through
// check_inputs(); a weight far beyond any trained value is named when the loss turns NaN.
TEST(Classifier, AForwardNanSaysWhetherTheInputsWereCheckedAndNamesHugeWeights) {
  Evidence e;
  e.loss_nonfinite = true;
  e.rank_loss = std::nan("");
  Diagnosis d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "forward");
  EXPECT_EQ(d.evidence[0], "the loss is NaN although the weights are finite");
  EXPECT_NE(d.evidence[1].find("the inputs were not checked"), std::string::npos);
  EXPECT_NE(d.fixes[0].find("check_inputs"), std::string::npos);
  e.inputs_checked = true;
  d = classify(e);
  EXPECT_EQ(d.evidence[0],
            "the loss is NaN although the weights are finite and check_inputs() found the "
            "inputs finite");
  e.huge_params = {"head.weight (largest 1e+30)"};
  d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "forward");
  EXPECT_NE(d.evidence[0].find("head.weight (largest 1e+30)"), std::string::npos) << d.evidence[0];
  // A huge weight with a finite loss is not an incident's evidence by itself.
  e.loss_nonfinite = false;
  e.grads_nonfinite = true;
  EXPECT_STRNE(to_string(classify(e).cause), "forward");
}

TEST(Classifier, ANonFiniteLossFromFiniteDataAndWeightsIsForward) {
  Evidence e;
  e.loss_nonfinite = true;
  e.grads_nonfinite = true;
  e.nan_count = 100;
  e.anomaly_op = "LogBackward0";
  e.inputs_checked = true;
  const Diagnosis d = classify(e);
  EXPECT_STREQ(to_string(d.cause), "forward");
  EXPECT_EQ(d.evidence[1], "anomaly mode names LogBackward0");
}

TEST(Classifier, NonFiniteGradientsFromAFiniteLossAreBackwardWithTheFirstTensor) {
  const Diagnosis d = classify(nan_grads());
  EXPECT_STREQ(to_string(d.cause), "backward");
  EXPECT_EQ(d.evidence[0],
            "the loss is finite but gradients hold NaN/Inf, first (in backward "
            "order) head.weight, blocks.1.qkv.weight");
}

TEST(Classifier, NothingToGoOnIsUnknown) {
  EXPECT_STREQ(to_string(classify(Evidence{}).cause), "unknown");
}

TEST(IncidentReport, MarkdownCarriesCauseEvidenceFixesAndHistory) {
  const nlohmann::json r = {
      {"step", 42},
      {"signal", "nonfinite_grad"},
      {"action", "skip_batch"},
      {"cause", "backward"},
      {"evidence", {"gradients hold NaN"}},
      {"fixes", {"add eps"}},
      {"tensors", {"head.weight"}},
      {"history", {{{"step", 41}, {"loss", 2.5}, {"grad_norm", nullptr}, {"outcome", "applied"}}}}};
  const std::string md = render_markdown(r);
  EXPECT_NE(md.find("# Incident at step 42: backward"), std::string::npos) << md;
  EXPECT_NE(md.find("- gradients hold NaN"), std::string::npos) << md;
  EXPECT_NE(md.find("1. add eps"), std::string::npos) << md;
  EXPECT_NE(md.find("| 41 | 2.5 | NaN/Inf |"), std::string::npos) << md;
  EXPECT_NE(md.find("`head.weight`"), std::string::npos) << md;
  EXPECT_FALSE(render_markdown(nlohmann::json::object()).empty());  // tolerant of missing fields
}

}  // namespace
}  // namespace forensics
}  // namespace stepguard
