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

// 3. Weights: a NaN in a parameter makes every forward pass NaN.
Found broken_weights(const Evidence& e) {
  if (e.nonfinite_params.empty()) return {};
  std::vector<std::string> evidence = {"parameters hold NaN/Inf before the step: " +
                                       join(e.nonfinite_params)};
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
  return diagnosis(Cause::kHardwareSuspect,
                   {"this rank's parameters differ from the other replicas' (replica check), "
                    "although every rank applies the same averaged update: silent corruption of "
                    "memory or an update this rank missed"},
                   {"roll back to a snapshot from before the replicas drifted (a policy rule on "
                    "replica_divergence with action rollback)",
                    "run the hardware checks of this node (GPU memory test, ECC counters, dmesg "
                    "Xid errors); drain it if it recurs"});
}

// 4. Precision: overflow under fp16 loss scaling.
Found precision_overflow(const Evidence& e) {
  if (e.grads_nonfinite && e.loss_scaling && e.fp32 == ReplayResult::kVanished) {
    return diagnosis(Cause::kPrecisionOverflow,
                     {"the batch is finite when replayed in fp32; with fp16 and loss scale " +
                      number(e.loss_scale) + " it overflowed"},
                     {"use bf16 instead of fp16", "lower loss_scale.init_scale or raise hysteresis",
                      "keep the overflowing layers (" + join(e.blamed_grads, 2) + ") in fp32"});
  }
  if (e.grads_nonfinite && !e.loss_nonfinite && e.loss_scaling && e.nan_count == 0 &&
      e.fp32 == ReplayResult::kNotRun) {
    return diagnosis(
        Cause::kPrecisionOverflow,
        {"only Inf gradients (no NaN) with a finite loss under loss scale " + number(e.loss_scale) +
         ": an fp16 overflow"},
        {"use bf16 instead of fp16", "lower loss_scale.init_scale or raise hysteresis"});
  }
  return {};
}

// 5. Learning rate: values blowing up over the last steps.
Found divergence(const Evidence& e) {
  const double typical_norm = median(e.recent_grad_norms);
  const bool norm_blowup =
      std::isfinite(typical_norm) && typical_norm > 0 && e.grad_norm > 100 * typical_norm;
  if (!(e.loss_spike || e.grad_norm_spike || norm_blowup)) return {};
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

// 6. The forward pass made the loss non-finite from finite data and weights.
Found forward_pass(const Evidence& e) {
  if (!e.loss_nonfinite) return {};
  std::vector<std::string> evidence = {
      "the loss is NaN/Inf although the inputs and weights are finite"};
  if (!e.first_bad_forward.empty()) {
    evidence.push_back("the first non-finite output in forward order: " + e.first_bad_forward);
  }
  if (!e.anomaly_op.empty()) evidence.push_back("anomaly mode names " + e.anomaly_op);
  return diagnosis(Cause::kForward, std::move(evidence),
                   {"add an eps to divisions and normalizations (0/0)",
                    "clamp before log and sqrt (log(0), sqrt of a negative)",
                    "subtract the max before exp/softmax; look for all-masked attention rows"});
}

// 7. The backward pass made the gradients non-finite from a finite loss.
Found backward_pass(const Evidence& e) {
  if (!e.grads_nonfinite) return {};
  std::vector<std::string> evidence = {
      "the loss is finite but gradients hold NaN/Inf, first (in backward order) " +
      (e.blamed_grads.empty() ? std::string("on another rank") : join(e.blamed_grads))};
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
  constexpr Found (*kDebuggingOrder[])(const Evidence&) = {
      not_reproduced,     bad_data,   broken_weights, diverged_replica,
      precision_overflow, divergence, forward_pass,   backward_pass};
  for (auto check : kDebuggingOrder) {
    if (Found d = check(e)) return *d;
  }
  return diagnosis(Cause::kUnknown, {"no rule matched the evidence"},
                   {"read the trace around this step"});
}

}  // namespace forensics
}  // namespace stepguard
