#include "csrc/forensics/classifier.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>

namespace stepguard {
namespace forensics {

namespace {

std::string join(const std::vector<std::string>& words, std::size_t max = 3) {
  std::string out;
  for (std::size_t i = 0; i < words.size() && i < max; ++i) out += (i ? ", " : "") + words[i];
  if (words.size() > max) out += " (+" + std::to_string(words.size() - max) + " more)";
  return out;
}

std::string number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

// The median of the finite values, or NaN.
double median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Diagnosis diagnosis(Cause cause, std::vector<std::string> evidence,
                    std::vector<std::string> fixes) {
  return Diagnosis{cause, std::move(evidence), std::move(fixes)};
}

using Found = std::optional<Diagnosis>;

// 1. Is it real? The same batch from the same state, run again, came out finite.
Found not_reproduced(const Evidence& e) {
  if (!(e.loss_nonfinite || e.grads_nonfinite) || e.rerun != ReplayResult::kVanished) return {};
  return diagnosis(Cause::kHardwareSuspect,
                   {"the same batch from the same state gave a finite result when run "
                    "again: the fault did not reproduce"},
                   {"run the hardware checks of this node (GPU memory test, ECC counters, dmesg "
                    "Xid errors)",
                    "cordon the node if it recurs there; compare the faulty ranks across "
                    "incidents"});
}

// 2. Data.
Found bad_data(const Evidence& e) {
  if (e.bad_inputs.empty()) return {};
  return diagnosis(Cause::kData, {"the batch itself is bad: " + join(e.bad_inputs)},
                   {"check the data shard and the preprocessing that produced this batch "
                    "(saved with the report)",
                    "filter NaN/Inf values, empty and all-padding sequences in the data loader"});
}

// 2b. One rank's loss spiked while the others' did not: that rank's batch.
Found one_rank_spike(const Evidence& e) {
  if (!e.loss_spike || e.spike_ranks.empty() || e.spike_ranks.size() >= e.rank_losses.size()) {
    return {};
  }
  std::vector<std::string> ranks;
  std::vector<std::string> spiked;
  std::vector<double> others;
  for (int r : e.spike_ranks) {
    ranks.push_back(std::to_string(r));
    spiked.push_back(number(e.rank_losses[static_cast<std::size_t>(r)]));
  }
  for (std::size_t r = 0; r < e.rank_losses.size(); ++r) {
    if (std::find(e.spike_ranks.begin(), e.spike_ranks.end(), static_cast<int>(r)) ==
        e.spike_ranks.end()) {
      others.push_back(e.rank_losses[r]);
    }
  }
  const std::string who = (ranks.size() > 1 ? "ranks " : "rank ") + join(ranks, 8);
  return diagnosis(Cause::kData,
                   {"the loss spiked on " + who + " only (" + join(spiked, 8) + " there, " +
                    number(median(others)) + " on the other ranks, " + number(e.loss_level) +
                    " before): one bad batch, not the training"},
                   {"skip that batch and inspect it: the data shard of " + who +
                        " at this step (saved with the report when check_inputs is used)",
                    "look for very long, repeated or mislabeled samples, or a corrupt shard"});
}

// 2c. The loss spiked again on the first step after a rollback, on the restored weights: they gave
// the level on their own batches, so these batches moved the loss (a new shard or mixture, or a
// corrupt stretch of data), not the weights or the LR.
Found spike_on_restored_weights(const Evidence& e) {
  if (!e.loss_spike || e.restored_from <= 0 || e.loss_nonfinite || e.grads_nonfinite) return {};
  return diagnosis(
      Cause::kData,
      {"the loss spiked again (" + number(e.loss) + ", against " + number(e.loss_level) +
       " before) on the first step after the rollback, on the weights restored from step " +
       std::to_string(e.restored_from) +
       "'s snapshot, which gave that level on their own batches: these batches moved the loss, "
       "not the weights or the learning rate"},
      {"look at the data from this position on: a shard or mixture boundary, or a corrupt "
       "stretch (saved with the report when check_inputs is used)",
       "if the new data is intended, its loss level is the new normal: each rollback here skips "
       "batches into the same data until limits.max_rollbacks aborts; let it through (a rule "
       "with 'consecutive' or 'after_step' on loss_spike, or alert instead of rollback)"});
}

// 3. Weights: a NaN in a parameter makes every forward pass NaN.
Found broken_weights(const Evidence& e) {
  const bool huge = e.loss_nonfinite && !e.huge_params.empty();
  if (e.nonfinite_params.empty() && !huge) return {};
  std::vector<std::string> evidence;
  if (!e.nonfinite_params.empty()) {
    evidence.push_back("parameters hold NaN/Inf before the step: " + join(e.nonfinite_params));
  }
  if (huge) {
    evidence.push_back(
        "parameters hold values above " + number(kHugeWeight) +
        " before the step, enough to overflow what they multiply: " + join(e.huge_params));
  }
  if (!e.first_bad_forward.empty()) {
    evidence.push_back("the first non-finite output in forward order: " + e.first_bad_forward);
  }
  return diagnosis(
      Cause::kForward, std::move(evidence),
      {"roll back to a snapshot from before the weights broke (policy action rollback)",
       "find the update that wrote them: look at the grad norm and loss scale history below"});
}

// 3b. A replica that drifted from the others while every rank applied the same averaged update:
// memory corruption or an update this rank missed.
Found diverged_replica(const Evidence& e) {
  if (!e.diverged_replica) return {};
  std::vector<std::string> evidence = {
      "this rank's parameters differ from the other replicas' (replica check), although every "
      "rank applies the same averaged update: silent corruption of memory or an update this rank "
      "missed"};
  if (!e.diverged_tensors.empty())
    evidence.push_back("the tensors that differ: " + join(e.diverged_tensors));
  return diagnosis(Cause::kHardwareSuspect, std::move(evidence),
                   {"roll back to a snapshot from before the replicas drifted (a policy rule on "
                    "replica_divergence with action rollback)",
                    "run the hardware checks of this node (GPU memory test, ECC counters, dmesg "
                    "Xid errors); drain it if it recurs"});
}

// 4. Precision: overflow under fp16 loss scaling. Real fp16 overflow is Inf in the gradients of
// a finite loss, with a few NaN among them where Inf met Inf (Inf - Inf, 0 * Inf): every step
// of such a streak is an overflow, unless a replay in fp32 reproduced it.
Found precision_overflow(const Evidence& e) {
  if (!e.grads_nonfinite || !e.loss_scaling || e.overflow_ruled_out ||
      e.fp32 == ReplayResult::kReproduced) {
    return {};
  }
  std::vector<std::string> evidence;
  if (e.fp32 == ReplayResult::kVanished) {
    evidence.push_back("the batch is finite when replayed in fp32; with fp16 and loss scale " +
                       number(e.loss_scale) + " it overflowed");
  } else if (!e.loss_nonfinite && e.inf_count > 0) {
    evidence.push_back(
        "Inf in the gradients (" + std::to_string(e.inf_count) + " Inf" +
        (e.nan_count > 0 ? ", " + std::to_string(e.nan_count) + " NaN where Inf met Inf" : "") +
        ") of a finite loss under loss scale " + number(e.loss_scale) + ": an fp16 overflow");
  } else if (!e.loss_nonfinite && e.nan_count > 0 && !e.loss_scale_at_floor) {
    // Overflowed gradients averaged over ranks: Inf + (-Inf) leaves NaN and no Inf.
    evidence.push_back("NaN in the gradients (" + std::to_string(e.nan_count) +
                       ") of a finite loss under loss scale " + number(e.loss_scale) +
                       ": an fp16 overflow whose Inf met Inf (in the gradient average), as the "
                       "scaler takes it; a replay in fp32 (set_replay) tells it from a NaN of "
                       "the backward");
  } else {
    return {};
  }
  std::vector<std::string> fixes;
  if (e.loss_scale_at_floor) {
    evidence.push_back("the loss scale is at its floor: it cannot back off any further");
    fixes = {"use bf16 instead of fp16",
             "keep the overflowing layers (" + join(e.blamed_grads, 2) + ") in fp32",
             "lower the learning rate: the values themselves outgrow fp16"};
  } else {
    evidence.push_back("the loss scale backs off and the step is skipped, as GradScaler does");
    fixes = {"nothing, if it stops within a few steps: the scale finds its level",
             "lower loss_scale.init_scale (or raise hysteresis) if every run starts like this",
             "use bf16 instead of fp16"};
  }
  return diagnosis(Cause::kPrecisionOverflow, std::move(evidence), std::move(fixes));
}

// 5. A trend detector's finding (a smooth rise, a stall, one rank's shifted loss), in its
// kind's words, when no spike or non-finite value explains the step.
Found trend(const Evidence& e) {
  if (e.trend_findings.empty() || e.loss_spike || e.loss_nonfinite || e.grads_nonfinite) {
    return std::nullopt;
  }
  return diagnosis(e.trend_cause, e.trend_findings, e.trend_fixes);
}

// 0. The optimizer state check: the state itself held NaN/Inf or a negative second moment before
// the update (no replay or weight check explains that better: the state was looked at).
Found optimizer_state(const Evidence& e) {
  if (e.state_findings.empty()) return std::nullopt;
  return diagnosis(Cause::kOptimizerState, e.state_findings, e.state_fixes);
}

// 6. Learning rate: values blowing up over the last steps.
Found divergence(const Evidence& e) {
  const double typical_norm = median(e.recent_grad_norms);
  const bool norm_blowup =
      std::isfinite(typical_norm) && typical_norm > 0 && e.grad_norm > 100 * typical_norm;
  const std::vector<std::string> lr_fixes = {
      "lower the learning rate (check the schedule: a peak or a restart that sets it too high)",
      "lengthen the warm-up",
      "clip the grad norm (policy action clip, or the framework's clipping)"};
  // A divergence that outlived a rollback and an LR cut: the LR itself.
  if (e.loss_not_recovered || (e.loss_spike && e.diverging_steps > 0)) {
    std::vector<std::string> evidence;
    if (e.loss_not_recovered) {
      evidence.push_back("the loss is " + number(e.loss) + " " + std::to_string(e.diverging_steps) +
                         " steps after the spike, against " + number(e.loss_level) +
                         " before it: it has not come back (raised " +
                         std::to_string(e.escalations) + (e.escalations == 1 ? " time" : " times") +
                         ")");
    } else {
      evidence.push_back("the loss spiked again (" + number(e.loss) + ", " + number(e.loss_level) +
                         " before the first spike " + std::to_string(e.diverging_steps) +
                         " steps ago) after a rollback and an LR cut");
    }
    const double growth = e.grad_norm_level > 0 ? e.grad_norm / e.grad_norm_level : 0.0;
    evidence.push_back(growth >= 1.5
                           ? "learning rate too high (the grad norm grew " + number(growth) +
                                 "x over " + std::to_string(e.diverging_steps) + " steps)"
                           : "learning rate too high: the loss stays up although the "
                             "LR was cut");
    return diagnosis(Cause::kDivergence, std::move(evidence), lr_fixes);
  }
  if (!(e.loss_spike || norm_blowup)) {
    if (!e.grad_norm_spike) return {};
    // One step's outsized gradient with the loss where it was: one batch, not a divergence
    // (that rises over many steps, and the recovery watch and the limits see it).
    return diagnosis(
        Cause::kUnknown,
        {"the grad norm rose to " + number(e.grad_norm) + " (typical " + number(typical_norm) +
         ") on this step while the loss stayed at " + number(e.loss) + " (typical " +
         number(median(e.recent_losses)) +
         "): one batch's gradient, not a divergence, which rises over many steps"},
        {"look at this step's batch (its length, its labels, a data-shard boundary)",
         "if it recurs every few steps, lower the learning rate or lengthen the warm-up"});
  }
  std::vector<std::string> evidence;
  if (e.loss_spike) {
    evidence.push_back("the loss jumped to " + number(e.loss) + " (typical " +
                       number(median(e.recent_losses)) + ")");
  }
  if (e.grad_norm_spike || norm_blowup) {
    evidence.push_back("the grad norm rose to " + number(e.grad_norm) + " (typical " +
                       number(typical_norm) + ")");
  }
  return diagnosis(
      Cause::kDivergence, std::move(evidence),
      {"lower the learning rate or lengthen the warm-up", "clip the grad norm (policy action clip)",
       "roll back and skip the batches around the spike (policy action rollback)"});
}

// 7. The forward pass made the loss non-finite from finite data and weights.
Found forward_pass(const Evidence& e) {
  if (!e.loss_nonfinite) return {};
  const std::string what = std::isinf(e.rank_loss)   ? "Inf"
                           : std::isnan(e.rank_loss) ? "NaN"
                                                     : "NaN/Inf";
  std::vector<std::string> evidence = {
      "the loss is " + what + " although the weights are finite" +
      (e.inputs_checked ? " and check_inputs() found the inputs finite" : "")};
  if (!e.inputs_checked) {
    evidence.push_back(
        "the inputs were not checked (call check_inputs(batch) before the step): "
        "a NaN/Inf in the batch looks the same from here");
  }
  if (!e.first_bad_forward.empty()) {
    evidence.push_back("the first non-finite output in forward order: " + e.first_bad_forward);
  } else if (!e.anomaly_op.empty()) {
    // For a NaN made in forward, anomaly mode names the backward of the loss op that met it:
    // worth saying only when nothing named the module.
    evidence.push_back("anomaly mode names " + e.anomaly_op);
  }
  std::vector<std::string> fixes;
  if (!e.inputs_checked)
    fixes.push_back("check the batch first: check_inputs(batch), or look at it");
  fixes.insert(fixes.end(),
               {"add an eps to divisions and normalizations (0/0)",
                "clamp before log and sqrt (log(0), sqrt of a negative)",
                "subtract the max before exp/softmax; look for all-masked attention rows"});
  return diagnosis(Cause::kForward, std::move(evidence), std::move(fixes));
}

// 8. The backward pass made the gradients non-finite from a finite loss.
Found backward_pass(const Evidence& e) {
  if (!e.grads_nonfinite) return {};
  std::vector<std::string> evidence = {
      "the loss is finite but gradients hold NaN/Inf, first (in backward order) " +
      (e.blamed_grads.empty() ? std::string("on another rank") : join(e.blamed_grads))};
  if (e.grads_bad_before_reduction) {
    evidence.push_back(
        "this rank's own gradients held NaN/Inf before the framework reduced "
        "them (the gradient watch): the fault was made on this rank");
  }
  if (!e.first_bad_backward.empty()) {
    evidence.push_back("the first non-finite gradient in backward order reached " +
                       e.first_bad_backward);
  }
  if (!e.anomaly_op.empty()) evidence.push_back("anomaly mode names " + e.anomaly_op);
  return diagnosis(Cause::kBackward, std::move(evidence),
                   {"look at the backward of the first blamed tensor's layer",
                    "guard sqrt/pow/div whose derivative is infinite at 0 (add eps)",
                    "check custom autograd functions"});
}

}  // namespace

Diagnosis classify(const Evidence& e) {
  // The standard debugging order: the first check that explains the evidence names the cause.
  constexpr Found (*kDebuggingOrder[])(const Evidence&) = {optimizer_state,
                                                           not_reproduced,
                                                           bad_data,
                                                           one_rank_spike,
                                                           spike_on_restored_weights,
                                                           broken_weights,
                                                           diverged_replica,
                                                           precision_overflow,
                                                           trend,
                                                           divergence,
                                                           forward_pass,
                                                           backward_pass};
  for (auto check : kDebuggingOrder) {
    if (Found d = check(e)) return *d;
  }
  return diagnosis(Cause::kUnknown, {"no rule matched the evidence"},
                   {"read the trace around this step"});
}

}  // namespace forensics
}  // namespace stepguard
