// Reading the trend detectors' sections of a policy file's `detectors` (csrc/policy/trend.h):
// each kind's section by its table entry, so a new kind needs nothing here.
#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

#include "csrc/policy/policy_file_internal.h"

namespace stepguard {
namespace policy {
namespace detail {

namespace {

// One kind's section: `name:` alone turns it on with the defaults; its fields are the kind's,
// each in its range.
void read_trend(const YAML::Node& node, const TrendKind& kind, TrendSettings* s, Checker* check,
                PolicyMarks* marks) {
  if (!node) return;
  const std::string name = kind.key;
  marks->configured_detectors.push_back(name);
  s->enabled = true;
  if (node.IsNull() || !check->map(node, name)) return;
  std::vector<std::string> keys = {"enabled"};
  for (const TrendField& f : kind.fields) keys.push_back(f.name);
  check->check_keys(node, keys, " in 'detectors." + name + "'");
  if (const YAML::Node n = node["enabled"]; n) check->boolean(n, "enabled", &s->enabled);
  for (std::size_t i = 0; i < kind.fields.size(); ++i) {
    const TrendField& f = kind.fields[i];
    const YAML::Node n = node[f.name];
    if (!n) continue;
    long long whole = 0;
    if (!f.whole) {
      check->number(n, f.name, f.low, f.high, false, false, &s->values[i]);
    } else if (check->whole_number(n, f.name, static_cast<long long>(f.low),
                                   static_cast<long long>(f.high), &whole)) {
      s->values[i] = static_cast<double>(whole);
    }
  }
}

}  // namespace

std::vector<std::string> detector_keys() {
  std::vector<std::string> keys = kDetectorKeys;
  for (const TrendKind& k : trend_kinds()) keys.push_back(k.key);
  return keys;
}

void read_trends(const YAML::Node& detectors, DetectorSettings* out, Checker* check,
                 PolicyMarks* marks) {
  const std::vector<TrendKind>& kinds = trend_kinds();
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    read_trend(detectors[kinds[i].key], kinds[i], &out->trends[i], check, marks);
  }
}

void enable_trend(const std::string& name, DetectorSettings* out) {
  const std::vector<TrendKind>& kinds = trend_kinds();
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    if (name == kinds[i].key) out->trends[i].enabled = true;
  }
}

bool is_trend_key(const std::string& word) {
  for (const TrendKind& k : trend_kinds()) {
    if (word == k.key) return true;
  }
  return false;
}

}  // namespace detail
}  // namespace policy
}  // namespace stepguard
