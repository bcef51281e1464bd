// detectors.stall: training that stopped moving. A step is stalled when its grad norm is exactly
// 0 (every gradient zero: a graph detached from the loss, frozen parameters), when the learning
// rate it is applied with is 0 (the largest group LR, as the port reads it, times the guard's LR
// factor: a schedule that reached 0), or when its loss is the one of the step before to the last
// bit. The signal is raised when `steps` steps in a row are stalled, and again every `steps`
// steps while they stay so. A non-finite step is not stalled (it is another detector's).
#include <cmath>
#include <stdexcept>

#include "csrc/policy/trend.h"

namespace stepguard {
namespace policy {
namespace {

using trend_detail::count_of;
using trend_detail::figure;
using trend_detail::finite_of;

class Stall final : public TrendDetector {
 public:
  explicit Stall(const std::vector<double>& v) : steps_(static_cast<std::int64_t>(v[0])) {}

  bool observe(const TrendInput& in, TrendNote* note) override {
    const GlobalStats& g = *in.stats;
    const bool loss_known = g.loss_given_ranks > 0 && std::isfinite(g.loss);
    const bool zero_grad = in.judged && g.grad_norm == 0.0 && !g.sum_squares_overflow;
    const double lr = g.largest_lr * in.lr_factor;
    const bool zero_lr = in.judged && std::isfinite(lr) && lr == 0.0;
    const bool flat = in.judged && loss_known && has_last_ && g.loss == last_loss_;
    has_last_ = in.judged && loss_known;
    last_loss_ = has_last_ ? g.loss : 0.0;
    if (!(zero_grad || zero_lr || flat)) {
      streak_ = 0;
      return false;
    }
    if (streak_++ == 0) since_ = in.step;
    if (streak_ % steps_ != 0) return false;
    std::string why;
    const auto add = [&why](const std::string& s) { why += (why.empty() ? "" : "; ") + s; };
    if (zero_grad) {
      add("the grad norm is exactly 0 (every gradient zero: a graph detached from the loss, "
          "frozen parameters, or a loss that does not depend on them)");
    }
    if (zero_lr) {
      add("the learning rate is 0 (largest group LR " + figure(g.largest_lr) +
          " x the guard's factor " + figure(in.lr_factor) + ")");
    }
    if (flat) add("the loss is the same to the last bit step after step (" + figure(g.loss) + ")");
    note->signal = Signal::kStall;
    note->level = zero_lr ? lr : g.grad_norm;
    note->reference = 0.0;
    note->since = since_;
    note->what = "training has not moved for " + std::to_string(streak_) + " steps (since step " +
                 std::to_string(since_) + "): " + why;
    return true;
  }

  std::vector<double> state() const override {
    return {static_cast<double>(streak_), static_cast<double>(since_), has_last_ ? 1.0 : 0.0,
            last_loss_};
  }

  void restore(const std::vector<double>& s) override {
    if (s.empty()) {
      streak_ = since_ = 0;
      has_last_ = false;
      last_loss_ = 0.0;
      return;
    }
    if (s.size() != 4) {
      throw std::invalid_argument("stepguard: policy state holds a stall state of " +
                                  std::to_string(s.size()) + " values, not 4");
    }
    streak_ = count_of(s[0], "a stall streak");
    since_ = count_of(s[1], "a stall start");
    has_last_ = s[2] != 0.0;
    last_loss_ = finite_of(s[3], "a stall's last loss");
  }

 private:
  std::int64_t steps_;
  std::int64_t streak_ = 0;  ///< stalled steps in a row
  std::int64_t since_ = 0;   ///< the first of them
  bool has_last_ = false;    ///< the step before was judged, with a loss
  double last_loss_ = 0.0;
};

std::string explain(const std::vector<double>& v) {
  return "stall: " + figure(v[0]) +
         " steps in a row with the grad norm exactly 0, the learning rate 0 (the largest group "
         "LR x the guard's factor) or the loss the same to the last bit (raised again every " +
         figure(v[0]) + " such steps)";
}

}  // namespace

TrendKind stall_kind() {
  return {"stall",
          Signal::kStall,
          Cause::kUnknown,
          {{"steps", 1, 1e9, 20, true}},
          {"check the learning-rate schedule (a scheduler that reached 0, a warm-up from 0 that "
           "never started, an LR set by hand)",
           "check that the loss depends on the parameters the optimizer holds (no detach(), "
           "requires_grad on, the model's parameters the ones given to the optimizer)"},
          explain,
          trend_detail::make<Stall>,
          /*reads_lr=*/true};
}

}  // namespace policy
}  // namespace stepguard
