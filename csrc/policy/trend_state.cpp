// detectors.optimizer_state: the optimizer state checked before the update, every `every` steps.
// The engine inspects the wrapped optimizer's state tensors on those steps in the step's fused
// pass (their NaN/Inf elements, and the finite elements below zero of the second moments, whose
// square root the update takes: Adam's exp_avg_sq, RMSprop's square_avg, Adagrad's sum, ...),
// and their count arrives with the step's one collective. Any such element raises the signal on
// that step, before the update that would write it into the weights: a state a bit flip, a bad
// checkpoint or an optimizer bug corrupted is named as such, at its step, not one step later as
// a NaN loss of the forward. Stateless: every check judges the state as it is.
#include <string>

#include "csrc/policy/trend.h"

namespace stepguard {
namespace policy {
namespace {

using trend_detail::figure;

class OptimizerState final : public TrendDetector {
 public:
  explicit OptimizerState(const std::vector<double>&) {}

  bool observe(const TrendInput& in, TrendNote* note) override {
    const GlobalStats& g = *in.stats;
    if (!g.state_checked || g.state_bad_count == 0) return false;
    std::string ranks;
    for (int r : g.state_bad_ranks) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    note->signal = Signal::kOptimizerState;
    note->level = static_cast<double>(g.state_bad_count);
    note->reference = 0.0;
    note->since = in.step;
    note->what = "the optimizer state holds " + std::to_string(g.state_bad_count) +
                 " NaN/Inf or negative second-moment element" +
                 (g.state_bad_count == 1 ? "" : "s") +
                 (ranks.empty() ? std::string() : " on rank " + ranks) +
                 ", found before the update, which would have written them into the weights";
    return true;
  }

  std::vector<double> state() const override { return {}; }
  void restore(const std::vector<double>&) override {}
};

std::string explain(const std::vector<double>& v) {
  return "optimizer_state: the optimizer state checked before the update " +
         (v[0] == 1 ? std::string("at every step") : "every " + figure(v[0]) + " steps") +
         " (NaN/Inf anywhere, a negative second moment), in the step's one pass and collective";
}

}  // namespace

TrendKind optimizer_state_kind() {
  TrendKind kind{"optimizer_state",
                 Signal::kOptimizerState,
                 Cause::kOptimizerState,
                 {{"every", 1, 1e9, 1, true}},
                 {"roll back to a snapshot (the default policy does): the snapshot's state is one "
                  "the check passed",
                  "if it came back after a resume, check the checkpoint's optimizer state (it was "
                  "saved or loaded corrupted)",
                  "if it recurs on one rank, run the hardware checks of that node (GPU memory "
                  "test, ECC counters, dmesg Xid errors)",
                  "a custom optimizer: check its update of the state (a second moment must stay "
                  ">= 0)"},
                 explain,
                 trend_detail::make<OptimizerState>};
  kind.reads_state = true;
  return kind;
}

}  // namespace policy
}  // namespace stepguard
