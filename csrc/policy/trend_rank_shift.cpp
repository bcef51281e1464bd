// detectors.rank_loss_shift: one rank's loss standing apart from the others' for several steps
// (its data, its labels, its shard of the model), which the mean loss blurs and a spike test of
// the mean misses. From the step buffer alone (no collective of its own): the largest rank loss
// is bounded by the ranks' spread (GlobalStats::loss_max_bound, equal to it when one rank stands
// out from ranks that agree), and the others' mean follows from it. The gap is the log of the top
// loss over the others' mean (a relative gap for losses at or below zero); it has running
// statistics (an EMA with a bias-corrected start, fed by the gaps of steps without a shift
// that are inside them). A shift is the median gap of the last `steps` steps more than `z`
// deviations above the gap's mean, and the top loss there at least `factor` times the others'
// (the median: one bad batch, a spike's business, never makes it); the signal is raised on
// every step while it lasts. The ranks' losses
// of small batches differ a lot from step to step: the median of a window and the log keep that
// noise from alarming. A shift also needs the others' loss near its own running level: a loss
// that rises on every rank (a divergence) widens the gap too, and is no one rank's. One rank:
// nothing to compare; nor while a loss spike's recovery is watched (the training is suspect, and
// the gap between ranks widens with it).
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "csrc/policy/detectors.h"
#include "csrc/policy/trend.h"

namespace stepguard {
namespace policy {
namespace {

using trend_detail::count_of;
using trend_detail::figure;
using trend_detail::finite_of;

/// The gap's EMA weight once the start is over (about the last 50 steps).
constexpr double kAlpha = 0.02;

class RankLossShift final : public TrendDetector {
 public:
  explicit RankLossShift(const std::vector<double>& v)
      : z_(v[0]),
        steps_(static_cast<std::size_t>(v[1])),
        warmup_(static_cast<std::int64_t>(v[2])),
        factor_(v[3]) {}

  bool observe(const TrendInput& in, TrendNote* note) override {
    const GlobalStats& g = *in.stats;
    const int n = g.world_size;
    if (!in.judged || in.watching || n < 2 || g.loss_given_ranks < n || !std::isfinite(g.loss) ||
        !std::isfinite(g.loss_max_bound)) {
      return false;
    }
    const double top = std::max(g.loss_max_bound, g.loss);
    const double others = (n * g.loss - top) / (n - 1);
    push(&gaps_, gap_of(top, others));
    push(&others_, others);
    const double median = recent_median(gaps_);
    const double threshold = mean_ + z_ * std::sqrt(variance_);
    // One rank moved while the others stayed: their loss near its own level (a loss rising on
    // every rank, a divergence, widens the gap between ranks too, and is not one rank's).
    const bool others_stayed = gap_of(recent_median(others_), level_) < 0.5 * gap_of(factor_, 1.0);
    const bool shifted = gaps_.size() == steps_ && count_ >= warmup_ && median > threshold &&
                         median >= gap_of(factor_ * std::abs(others), std::abs(others)) &&
                         others_stayed;
    if (!shifted) {
      since_ = 0;
      // A gap beyond the threshold (one bad batch, the first steps of a shift) does not move the
      // statistics, so that it cannot hide the shift that follows.
      if (count_ >= warmup_ && gaps_.back() > threshold) return false;
      const double alpha = std::max(kAlpha, 1.0 / static_cast<double>(count_ + 1));
      const double delta = gaps_.back() - mean_;
      mean_ += alpha * delta;
      variance_ = (1.0 - alpha) * (variance_ + alpha * delta * delta);
      level_ += alpha * (others - level_);
      ++count_;
      return false;
    }
    if (since_ == 0) since_ = in.step;
    note->signal = Signal::kRankLossShift;
    note->level = top;
    note->reference = others;
    note->since = since_;
    note->what = "one rank's loss has stood apart from the others' (since step " +
                 std::to_string(since_) + "): " + figure(top) + " against " + figure(others) +
                 " (the others' mean, about their usual " + figure(level_) + "); over the last " +
                 std::to_string(steps_) + " steps typically " + figure(std::exp(median)) +
                 "x theirs, where the ranks' losses usually differ by " + figure(std::exp(mean_)) +
                 "x";
    return true;
  }

  std::vector<double> state() const override {
    std::vector<double> s = {static_cast<double>(count_), mean_, variance_,
                             static_cast<double>(since_), level_};
    s.insert(s.end(), gaps_.begin(), gaps_.end());
    s.insert(s.end(), others_.begin(), others_.end());
    return s;
  }

  void restore(const std::vector<double>& s) override {
    if (s.empty()) {
      count_ = since_ = 0;
      mean_ = variance_ = level_ = 0.0;
      gaps_.clear();
      others_.clear();
      return;
    }
    if (s.size() < 5 || (s.size() - 5) % 2 != 0 || (s.size() - 5) / 2 > steps_) {
      throw std::invalid_argument("stepguard: policy state holds a rank_loss_shift state of " +
                                  std::to_string(s.size()) + " values, not 5 + 2 x up to " +
                                  std::to_string(steps_) + " (another window?)");
    }
    count_ = count_of(s[0], "a rank_loss_shift count");
    mean_ = finite_of(s[1], "a rank_loss_shift mean");
    variance_ = finite_of(s[2], "a rank_loss_shift variance");
    if (variance_ < 0) {
      throw std::invalid_argument("stepguard: policy state holds a negative rank gap variance");
    }
    since_ = count_of(s[3], "a rank_loss_shift start");
    level_ = finite_of(s[4], "a rank_loss_shift level");
    const std::size_t k = (s.size() - 5) / 2;
    gaps_.assign(s.begin() + 5, s.begin() + 5 + static_cast<std::ptrdiff_t>(k));
    others_.assign(s.begin() + 5 + static_cast<std::ptrdiff_t>(k), s.end());
    for (double v : gaps_) finite_of(v, "a rank gap");
    for (double v : others_) finite_of(v, "a rank loss");
  }

 private:
  // The log of top over others for positive losses; a relative gap otherwise.
  static double gap_of(double top, double others) {
    if (others > 0 && top > 0) return std::log(top / others);
    return (top - others) / std::max(std::abs(others), 1e-12);
  }

  void push(std::vector<double>* window, double v) const {
    window->push_back(v);
    if (window->size() > steps_) window->erase(window->begin());
  }

  double z_;
  std::size_t steps_;
  std::int64_t warmup_;
  double factor_;
  std::vector<double> gaps_;    ///< the last `steps` gaps, newest last
  std::vector<double> others_;  ///< the others' mean loss on those steps
  std::int64_t count_ = 0;      ///< steps folded into the statistics
  double mean_ = 0.0;           ///< the gap's EMA mean and variance
  double variance_ = 0.0;
  double level_ = 0.0;      ///< the others' mean loss, its EMA
  std::int64_t since_ = 0;  ///< the first step of the shift being raised (0: none)
};

std::string explain(const std::vector<double>& v) {
  return "rank_loss_shift: over the last " + figure(v[1]) +
         " steps, one rank's loss typically (the median) " + figure(v[3]) +
         "x the others' mean and more than " + figure(v[0]) +
         " deviations above the usual gap between ranks, the others' loss where it was (after " +
         figure(v[2]) +
         " steps; raised on every step while it lasts; quiet while a spike's recovery is "
         "watched; one rank: off)";
}

}  // namespace

TrendKind rank_loss_shift_kind() {
  return {"rank_loss_shift",
          Signal::kRankLossShift,
          Cause::kData,
          {{"z", 1, 1e6, 3, false},
           {"steps", 3, 1000, 5, true},
           {"warmup", 0, 1e9, 100, true},
           {"factor", 1.01, 1e6, 1.5, false}},
          {"check the batches of the rank named: its data shard, its labels, its tokenizer or "
           "preprocessing",
           "if its data is the same as the others', check that rank's hardware (run the same "
           "batch on another rank)"},
          explain,
          trend_detail::make<RankLossShift>};
}

}  // namespace policy
}  // namespace stepguard
