// detectors.loss_trend: smooth divergence. The mean loss of the last `window` judged steps
// against the mean of the `window` before them: the loss is rising while the newer mean is above
// the older (by more than kMinRise of it). A step change (a new data shard, a spike that settles
// high) lifts the newer window for at most 2 * window steps; a divergence keeps rising. The signal
// is raised when the loss has been rising for more than 2 * window steps and the newer mean is
// `factor` times the lowest window mean seen after `warmup` judged steps; that lowest level is
// then moved up to the mean that raised it, so the signal comes again only at a further rise of
// `factor`. A loss that falls, or a spike that comes back, never raises it; nor does a loss
// watched after a spike (detectors.loss_recovery acts on that one).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "csrc/policy/detectors.h"
#include "csrc/policy/trend.h"

namespace stepguard {
namespace policy {
namespace {

using trend_detail::count_of;
using trend_detail::figure;
using trend_detail::finite_of;

/// How much the newer window's mean must exceed the older's to count as rising.
constexpr double kMinRise = 0.01;

class LossTrend final : public TrendDetector {
 public:
  explicit LossTrend(const std::vector<double>& v)
      : window_(static_cast<std::size_t>(v[0])),
        factor_(v[1]),
        warmup_(static_cast<std::int64_t>(v[2])) {}

  bool observe(const TrendInput& in, TrendNote* note) override {
    const GlobalStats& g = *in.stats;
    if (!in.judged || g.loss_given_ranks == 0 || !std::isfinite(g.loss)) return false;
    recent_.push_back(g.loss);
    if (recent_.size() > 2 * window_) recent_.erase(recent_.begin());
    ++count_;
    if (recent_.size() < 2 * window_) return false;
    const auto mid = recent_.begin() + static_cast<std::ptrdiff_t>(window_);
    const double older = std::accumulate(recent_.begin(), mid, 0.0) / window_;
    const double newer = std::accumulate(mid, recent_.end(), 0.0) / window_;
    if (rose_above(newer, older, std::abs(older), 1.0 + kMinRise)) {
      if (rising_ == 0) since_ = in.step - static_cast<std::int64_t>(window_);
      ++rising_;
    } else {
      rising_ = 0;
    }
    if (count_ < warmup_) return false;
    lowest_ = has_lowest_ ? std::min(lowest_, newer) : newer;
    has_lowest_ = true;
    if (in.watching || rising_ <= static_cast<std::int64_t>(2 * window_) ||
        !rose_above(newer, lowest_, std::abs(lowest_), factor_)) {
      return false;
    }
    note->signal = Signal::kLossTrend;
    note->level = newer;
    note->reference = lowest_;
    note->since = since_;
    note->what = "the loss has been rising for " + std::to_string(in.step - since_) +
                 " steps (since about step " + std::to_string(since_) +
                 "): its mean over the last " + std::to_string(window_) + " steps is " +
                 figure(newer) + ", " + figure(newer / lowest_) + "x its lowest (" +
                 figure(lowest_) + "), with no spike a spike test would see";
    lowest_ = newer;  // raised again only at a further rise of `factor`
    return true;
  }

  std::vector<double> state() const override {
    std::vector<double> s = {static_cast<double>(count_), static_cast<double>(rising_),
                             static_cast<double>(since_), has_lowest_ ? 1.0 : 0.0, lowest_};
    s.insert(s.end(), recent_.begin(), recent_.end());
    return s;
  }

  void restore(const std::vector<double>& s) override {
    if (s.empty()) {
      *this = LossTrend({static_cast<double>(window_), factor_, static_cast<double>(warmup_)});
      return;
    }
    if (s.size() < 5 || s.size() - 5 > 2 * window_) {
      throw std::invalid_argument("stepguard: policy state holds a loss_trend state of " +
                                  std::to_string(s.size()) + " values, not 5 to " +
                                  std::to_string(5 + 2 * window_) + " (another window?)");
    }
    count_ = count_of(s[0], "a loss_trend count");
    rising_ = count_of(s[1], "a loss_trend rise");
    since_ = count_of(s[2], "a loss_trend start");
    has_lowest_ = s[3] != 0.0;
    lowest_ = finite_of(s[4], "a loss_trend level");
    recent_.clear();
    for (std::size_t i = 5; i < s.size(); ++i) recent_.push_back(finite_of(s[i], "a loss"));
  }

 private:
  std::size_t window_;
  double factor_;
  std::int64_t warmup_;
  std::vector<double> recent_;  ///< the last 2 * window judged losses, newest last
  std::int64_t count_ = 0;      ///< judged losses seen
  std::int64_t rising_ = 0;     ///< steps in a row the newer window's mean was above the older's
  std::int64_t since_ = 0;      ///< about where the rise began
  bool has_lowest_ = false;
  double lowest_ = 0.0;  ///< the lowest window mean after the warm-up (moved up at each raise)
};

std::string explain(const std::vector<double>& v) {
  return "loss_trend: the loss's mean over the last " + figure(v[0]) +
         " steps has been above the mean of the " + figure(v[0]) + " before them for more than " +
         figure(2 * v[0]) + " steps (a step change rises for at most that long) and stands " +
         figure(v[1]) + "x above its lowest after " + figure(v[2]) +
         " steps (raised again at each further rise of " + figure(v[1]) +
         "x; quiet while a spike's recovery is watched)";
}

}  // namespace

TrendKind loss_trend_kind() {
  return {"loss_trend",
          Signal::kLossTrend,
          Cause::kDivergence,
          {{"window", 5, 1000, 50, true},
           {"factor", 1.01, 100, 1.3, false},
           {"warmup", 0, 1e9, 100, true}},
          {"lower the learning rate, and check the schedule (a warm-up that ends too high, a "
           "restart that jumped the LR back up)",
           "look for a weight or optimizer-state growth the grad norm follows (weight decay "
           "off, an output layer or a norm's scale growing)",
           "roll back to a checkpoint from before the rise began"},
          explain,
          trend_detail::make<LossTrend>};
}

}  // namespace policy
}  // namespace stepguard
