#include "csrc/forensics/classifier.h"

#include <algorithm>
#include <cmath>
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

}  // namespace

Diagnosis classify(const Evidence& e) {
  Diagnosis d;
  const bool nonfinite = e.loss_nonfinite || e.grads_nonfinite;

  // 1. Is it real? The same batch from the same state, run again, came out finite.
  if (nonfinite && e.rerun == ReplayResult::kVanished) {
    d.cause = "hardware_suspect";
    d.evidence.push_back(
        "the same batch from the same state gave a finite result when run "
        "again: the fault did not reproduce");
    d.fixes = {
        "run the hardware checks of this node (GPU memory test, ECC counters, dmesg Xid "
        "errors)",
        "cordon the node if it recurs there; compare the faulty ranks across incidents"};
    return d;
  }
  // 2. Data.
  if (!e.bad_inputs.empty()) {
    d.cause = "data";
    d.evidence.push_back("the batch itself is bad: " + join(e.bad_inputs));
    d.fixes = {
        "check the data shard and the preprocessing that produced this batch (saved with "
        "the report)",
        "filter NaN/Inf values, empty and all-padding sequences in the data loader"};
    return d;
  }
  // 3. Weights: a NaN in a parameter makes every forward pass NaN.
  if (!e.nonfinite_params.empty()) {
    d.cause = "forward";
    d.evidence.push_back("parameters hold NaN/Inf before the step: " + join(e.nonfinite_params));
    d.fixes = {"roll back to a snapshot from before the weights broke (policy action rollback)",
               "find the update that wrote them: look at the grad norm and loss scale history "
               "below"};
    return d;
  }
  // 4. Precision: overflow under fp16 loss scaling.
  if (e.grads_nonfinite && e.loss_scaling && e.fp32 == ReplayResult::kVanished) {
    d.cause = "precision_overflow";
    d.evidence.push_back("the batch is finite when replayed in fp32; with fp16 and loss scale " +
                         number(e.loss_scale) + " it overflowed");
    d.fixes = {"use bf16 instead of fp16", "lower loss_scale.init_scale or raise hysteresis",
               "keep the overflowing layers (" + join(e.blamed_grads, 2) + ") in fp32"};
    return d;
  }
  if (e.grads_nonfinite && !e.loss_nonfinite && e.loss_scaling && e.nan_count == 0 &&
      e.fp32 == ReplayResult::kNotRun) {
    d.cause = "precision_overflow";
    d.evidence.push_back("only Inf gradients (no NaN) with a finite loss under loss scale " +
                         number(e.loss_scale) + ": an fp16 overflow");
    d.fixes = {"use bf16 instead of fp16", "lower loss_scale.init_scale or raise hysteresis"};
    return d;
  }
  // 5. Learning rate: values blowing up over the last steps.
  const double typical_norm = median(e.recent_grad_norms);
  const bool norm_blowup =
      std::isfinite(typical_norm) && typical_norm > 0 && e.grad_norm > 100 * typical_norm;
  if (e.loss_spike || e.grad_norm_spike || norm_blowup) {
    d.cause = "divergence";
    if (e.loss_spike) {
      d.evidence.push_back("the loss jumped to " + number(e.loss) + " (typical " +
                           number(median(e.recent_losses)) + ")");
    }
    if (e.grad_norm_spike || norm_blowup) {
      d.evidence.push_back("the grad norm rose to " + number(e.grad_norm) + " (typical " +
                           number(typical_norm) + ")");
    }
    d.fixes = {"lower the learning rate or lengthen the warm-up",
               "clip the grad norm (policy action clip)",
               "roll back and skip the batches around the spike (policy action rollback)"};
    return d;
  }
  // 6. The forward pass made the loss non-finite from finite data and weights.
  if (e.loss_nonfinite) {
    d.cause = "forward";
    d.evidence.push_back("the loss is NaN/Inf although the inputs and weights are finite");
    if (!e.first_bad_forward.empty()) {
      d.evidence.push_back("the first non-finite output in forward order: " + e.first_bad_forward);
    }
    if (!e.anomaly_op.empty()) {
      d.evidence.push_back("anomaly mode names " + e.anomaly_op);
    }
    d.fixes = {"add an eps to divisions and normalizations (0/0)",
               "clamp before log and sqrt (log(0), sqrt of a negative)",
               "subtract the max before exp/softmax; look for all-masked attention rows"};
    return d;
  }
  // 7. The backward pass made the gradients non-finite from a finite loss.
  if (e.grads_nonfinite) {
    d.cause = "backward";
    d.evidence.push_back(
        "the loss is finite but gradients hold NaN/Inf, first (in backward "
        "order) " +
        (e.blamed_grads.empty() ? std::string("on another rank") : join(e.blamed_grads)));
    if (!e.first_bad_backward.empty()) {
      d.evidence.push_back("the first non-finite gradient in backward order reached " +
                           e.first_bad_backward);
    }
    if (!e.anomaly_op.empty()) d.evidence.push_back("anomaly mode names " + e.anomaly_op);
    d.fixes = {"look at the backward of the first blamed tensor's layer",
               "guard sqrt/pow/div whose derivative is infinite at 0 (add eps)",
               "check custom autograd functions"};
    return d;
  }
  d.evidence.push_back("no rule matched the evidence");
  d.fixes = {"read the trace around this step"};
  return d;
}

}  // namespace forensics
}  // namespace stepguard
