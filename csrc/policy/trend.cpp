#include "csrc/policy/trend.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

namespace stepguard {
namespace policy {

const std::vector<TrendKind>& trend_kinds() {
  static const std::vector<TrendKind> kinds = {loss_trend_kind(), stall_kind(),
                                               rank_loss_shift_kind(), optimizer_state_kind()};
  return kinds;
}

const TrendKind* trend_kind(Signal signal) {
  for (const TrendKind& k : trend_kinds()) {
    if (k.signal == signal) return &k;
  }
  return nullptr;
}

std::vector<TrendSettings> default_trend_settings() {
  std::vector<TrendSettings> out;
  for (const TrendKind& k : trend_kinds()) {
    TrendSettings s;
    for (const TrendField& f : k.fields) s.values.push_back(f.fallback);
    out.push_back(std::move(s));
  }
  return out;
}

bool trends_read_lr(const std::vector<TrendSettings>& settings) {
  const auto& kinds = trend_kinds();
  for (std::size_t i = 0; i < settings.size() && i < kinds.size(); ++i) {
    if (settings[i].enabled && kinds[i].reads_lr) return true;
  }
  return false;
}

std::int64_t state_check_every(const std::vector<TrendSettings>& settings) {
  const auto& kinds = trend_kinds();
  for (std::size_t i = 0; i < settings.size() && i < kinds.size(); ++i) {
    if (settings[i].enabled && kinds[i].reads_state && !settings[i].values.empty()) {
      return static_cast<std::int64_t>(settings[i].values[0]);
    }
  }
  return 0;
}

namespace trend_detail {

std::int64_t count_of(double word, const char* what) {
  if (!(word >= 0 && word <= 4503599627370496.0) || word != std::floor(word)) {
    throw std::invalid_argument(std::string("stepguard: policy state holds ") + what + " " +
                                figure(word) + ", not a whole number in [0, 2^52]");
  }
  return static_cast<std::int64_t>(word);
}

double finite_of(double word, const char* what) {
  if (!std::isfinite(word)) {
    throw std::invalid_argument(std::string("stepguard: policy state holds ") + what +
                                " that is not a finite number");
  }
  return word;
}

std::string figure(double v) {
  std::ostringstream s;
  s.precision(6);
  s << v;
  return s.str();
}

}  // namespace trend_detail
}  // namespace policy
}  // namespace stepguard
