// The engine's state as 64-bit words (snapshots, checkpoints, the cross-rank digest) and the
// checks a state read back must pass.
#include <cmath>
#include <stdexcept>
#include <string>

#include "csrc/common/bits.h"
#include "csrc/policy/policy.h"

namespace stepguard {
namespace policy {

std::vector<std::int64_t> EngineState::encode() const {
  std::vector<std::int64_t> w = {consecutive_bad_steps,
                                 bad_steps_total,
                                 bits_of(loss_ema.mean),
                                 bits_of(loss_ema.variance),
                                 loss_ema.count,
                                 bits_of(grad_norm_ema.mean),
                                 bits_of(grad_norm_ema.variance),
                                 grad_norm_ema.count,
                                 bits_of(loss_ratio.reference_max),
                                 loss_ratio.count,
                                 static_cast<std::int64_t>(rules.size())};
  auto list = [&w](const std::vector<std::int64_t>& v) {
    w.push_back(static_cast<std::int64_t>(v.size()));
    w.insert(w.end(), v.begin(), v.end());
  };
  for (const RuleState& r : rules) {
    w.push_back(r.streak);
    w.push_back(r.last_fired);
    w.push_back(r.fired);
    list(r.recent);
  }
  list(recent_skips);
  list(recent_rollbacks);
  // Appended in this release (a state without them decodes with them empty).
  for (const std::vector<double>* recent : {&loss_ema.recent, &grad_norm_ema.recent}) {
    w.push_back(static_cast<std::int64_t>(recent->size()));
    for (double v : *recent) w.push_back(bits_of(v));
  }
  for (std::int64_t v :
       {watch.started, watch.window_start, bits_of(watch.loss_level),
        bits_of(watch.grad_norm_level), bits_of(watch.loss_now), watch.escalations}) {
    w.push_back(v);
  }
  w.push_back(static_cast<std::int64_t>(rules_digest));   // appended in 0.9
  w.push_back(static_cast<std::int64_t>(trends.size()));  // appended with the trend detectors
  for (const std::vector<double>& t : trends) {
    w.push_back(static_cast<std::int64_t>(t.size()));
    for (double v : t) w.push_back(bits_of(v));
  }
  // Appended with the detrended z-score (a state without them decodes with a spread of 0).
  w.push_back(bits_of(loss_ema.spread));
  w.push_back(bits_of(grad_norm_ema.spread));
  return w;
}

std::uint64_t rules_digest(const std::vector<Rule>& rules) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the fields' 64-bit values
  const auto mix = [&h](std::uint64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= (v >> (8 * b)) & 0xFF;
      h *= 0x100000001b3ull;
    }
  };
  mix(rules.size());
  for (const Rule& r : rules) {
    for (std::int64_t v :
         {static_cast<std::int64_t>(r.on), r.consecutive, r.within_steps, r.within_count,
          r.after_step, r.cooldown, static_cast<std::int64_t>(r.action.type)}) {
      mix(static_cast<std::uint64_t>(v));
    }
  }
  return h == 0 ? 1 : h;  // 0 means "not recorded"
}

namespace {

// Reads the 64-bit words of an encoded state in order, each length checked against what is left.
class WordReader {
 public:
  explicit WordReader(const std::vector<std::int64_t>& words) : words_(words) {}
  bool done() const noexcept { return at_ >= words_.size(); }
  std::int64_t next() {
    if (at_ >= words_.size()) throw std::invalid_argument("stepguard: policy state is truncated");
    return words_[at_++];
  }
  void list(std::vector<std::int64_t>* v) {
    const std::int64_t n = next();
    check_length(n, "list length");
    v->assign(words_.begin() + static_cast<std::ptrdiff_t>(at_),
              words_.begin() + static_cast<std::ptrdiff_t>(at_ + static_cast<std::size_t>(n)));
    at_ += static_cast<std::size_t>(n);
  }
  void doubles(std::vector<double>* v) {
    std::vector<std::int64_t> bits;
    list(&bits);
    for (std::int64_t b : bits) v->push_back(double_of(b));
  }
  void check_length(std::int64_t n, const char* what) const {
    if (n < 0 || static_cast<std::size_t>(n) > words_.size() - at_) {
      throw std::invalid_argument(std::string("stepguard: policy state holds a bad ") + what);
    }
  }

 private:
  const std::vector<std::int64_t>& words_;
  std::size_t at_ = 0;
};

// The words appended after the first release's, each group optional (an older state ends before
// it): the recent windows and the recovery watch, the rules' digest, the trend detectors, the
// detrended spreads.
void decode_appended(WordReader& r, EngineState* s) {
  if (!r.done()) {
    for (std::vector<double>* recent : {&s->loss_ema.recent, &s->grad_norm_ema.recent}) {
      r.doubles(recent);
    }
    s->watch.started = r.next();
    s->watch.window_start = r.next();
    s->watch.loss_level = double_of(r.next());
    s->watch.grad_norm_level = double_of(r.next());
    s->watch.loss_now = double_of(r.next());
    s->watch.escalations = r.next();
  }
  if (!r.done()) s->rules_digest = static_cast<std::uint64_t>(r.next());
  if (!r.done()) {  // the trend detectors' states (their own checks at restore)
    const std::int64_t kinds = r.next();
    if (kinds < 0 || kinds > 64) {
      throw std::invalid_argument("stepguard: policy state holds a bad trend detector count");
    }
    s->trends.resize(static_cast<std::size_t>(kinds));
    for (std::vector<double>& t : s->trends) r.doubles(&t);
  }
  if (!r.done()) {
    s->loss_ema.spread = double_of(r.next());
    s->grad_norm_ema.spread = double_of(r.next());
  }
  if (!r.done()) throw std::invalid_argument("stepguard: policy state has extra words");
}

}  // namespace

EngineState EngineState::decode(const std::vector<std::int64_t>& words, std::size_t rule_count,
                                std::uint64_t digest, bool* rules_reset) {
  WordReader r(words);
  EngineState s;
  s.consecutive_bad_steps = r.next();
  s.bad_steps_total = r.next();
  s.loss_ema.mean = double_of(r.next());
  s.loss_ema.variance = double_of(r.next());
  s.loss_ema.count = r.next();
  s.grad_norm_ema.mean = double_of(r.next());
  s.grad_norm_ema.variance = double_of(r.next());
  s.grad_norm_ema.count = r.next();
  s.loss_ratio.reference_max = double_of(r.next());
  s.loss_ratio.count = r.next();
  const std::int64_t n = r.next();
  r.check_length(n, "rule count");
  s.rules.resize(static_cast<std::size_t>(n));
  for (RuleState& rule : s.rules) {
    rule.streak = r.next();
    rule.last_fired = r.next();
    rule.fired = r.next();
    r.list(&rule.recent);
  }
  r.list(&s.recent_skips);
  r.list(&s.recent_rollbacks);
  decode_appended(r, &s);
  s.check_ranges();
  const bool other_rules =
      s.rules_digest != 0 ? s.rules_digest != digest : s.rules.size() != rule_count;
  if (other_rules && s.rules_digest == 0) {
    throw std::invalid_argument("stepguard: policy state holds " + std::to_string(n) +
                                " rules, the policy has " + std::to_string(rule_count));
  }
  if (rules_reset != nullptr) *rules_reset = other_rules;
  if (other_rules) s.rules.assign(rule_count, RuleState{});
  s.rules_digest = digest;
  return s;
}

namespace {

constexpr std::int64_t kMaxCount = kMaxDecodedCount;

void check_count(const char* what, std::int64_t v) {
  if (v < 0 || v > kMaxCount) {
    throw std::invalid_argument(std::string("stepguard: policy state holds ") + what + " " +
                                std::to_string(v) + ", not in [0, 2^52]");
  }
}

void check_ema(const char* what, const EmaZScoreState& e) {
  check_count(what, e.count);
  if (!std::isfinite(e.mean) || !std::isfinite(e.variance) || e.variance < 0 ||
      !std::isfinite(e.spread) || e.spread < 0) {
    throw std::invalid_argument(
        std::string("stepguard: policy state holds a ") + what +
        " average that is not a finite number (mean " + std::to_string(e.mean) + ", variance " +
        std::to_string(e.variance) + ", spread " + std::to_string(e.spread) + ")");
  }
}

}  // namespace

void EngineState::check_ranges() const {
  check_count("consecutive_bad_steps", consecutive_bad_steps);
  for (const std::vector<double>* recent : {&loss_ema.recent, &grad_norm_ema.recent}) {
    if (recent->size() > 1024) {
      throw std::invalid_argument("stepguard: policy state holds a recent window of " +
                                  std::to_string(recent->size()) + " values, more than 1024");
    }
    for (double v : *recent) {
      if (!std::isfinite(v)) {
        throw std::invalid_argument(
            "stepguard: policy state holds a recent value that is not a finite number");
      }
    }
  }
  check_count("a recovery watch's start", watch.started);
  check_count("a recovery watch's window start", watch.window_start);
  check_count("a recovery watch's escalations", watch.escalations);
  if (!std::isfinite(watch.loss_level) || !std::isfinite(watch.grad_norm_level) ||
      !std::isfinite(watch.loss_now)) {
    throw std::invalid_argument(
        "stepguard: policy state holds a recovery watch level that is not a finite number");
  }
  check_count("bad_steps_total", bad_steps_total);
  check_ema("loss", loss_ema);
  check_ema("grad_norm", grad_norm_ema);
  check_count("a loss_ratio count", loss_ratio.count);
  if (loss_ratio.count > 0 && !std::isfinite(loss_ratio.reference_max)) {
    throw std::invalid_argument(
        "stepguard: policy state holds a loss_ratio reference that is not "
        "a finite number");
  }
  for (const RuleState& r : rules) {
    check_count("a rule streak", r.streak);
    check_count("a rule's last firing step", r.last_fired);
    check_count("a rule's firing count", r.fired);
    for (std::int64_t step : r.recent) check_count("a rule's recent step", step);
  }
  for (std::int64_t step : recent_skips) check_count("a recent skip's step", step);
  for (std::int64_t step : recent_rollbacks) check_count("a recent rollback's step", step);
}

void EngineState::check_not_after(std::int64_t step) const {
  const auto after = [step](const char* what, std::int64_t at) {
    if (at > step) {
      throw std::invalid_argument(std::string("stepguard: policy state holds ") + what + " " +
                                  std::to_string(at) + ", after its own step " +
                                  std::to_string(step));
    }
  };
  for (const RuleState& r : rules) {
    after("a rule's last firing at step", r.last_fired);
    for (std::int64_t at : r.recent) after("a rule's recent firing at step", at);
  }
  for (std::int64_t at : recent_skips) after("a skip at step", at);
  for (std::int64_t at : recent_rollbacks) after("a rollback at step", at);
  after("a recovery watch started at step", watch.started);
  after("a recovery watch window started at step", watch.window_start);
}

}  // namespace policy
}  // namespace stepguard
