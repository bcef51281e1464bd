// Policy scenarios for the policy-engine and step-controller tests: a step of a scenario by
// letter, a decision as text, a policy from YAML.
#pragma once

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "csrc/core/stats.h"
#include "csrc/policy/policy.h"
#include "csrc/policy/policy_file.h"

namespace stepguard {
namespace testing_support {

// One step of a scenario, by letter:
//   c clean (loss 1.0/1.1 and grad norm 2.0/2.2 alternating by step parity)
//   n NaN gradients        l NaN loss        d a rank whose state digest differs
//   S loss spike (loss 100)   G grad-norm spike (norm 100)
inline GlobalStats stats_for(char kind, std::int64_t step) {
  GlobalStats g;
  g.loss = 1.0 + 0.1 * static_cast<double>(step % 2);
  g.grad_norm = 2.0 + 0.2 * static_cast<double>(step % 2);
  switch (kind) {
    case 'c':
      break;
    case 'n':
      g.nan_count = 3;
      g.faulty_ranks = {0};
      break;
    case 'l':
      g.loss = std::numeric_limits<double>::quiet_NaN();
      g.loss_nonfinite_ranks = 1;
      break;
    case 'd':
      g.desynced_ranks = {1};
      break;
    case 'S':
      g.loss = 100.0;
      break;
    case 'G':
      g.grad_norm = 100.0;
      break;
    default:
      throw std::invalid_argument(std::string("unknown step kind ") + kind);
  }
  g.sum_squares = g.grad_norm * g.grad_norm;
  return g;
}

// "skip_batch+lower_lr", "rollback(10)", "apply+clip": the decision's actions, in order.
inline std::string describe(const Decision& d) {
  std::string out;
  for (Action a : d.actions) {
    out += (out.empty() ? "" : "+") + std::string(to_string(a));
    if (a == Action::kRollback) out += "(" + std::to_string(d.batches_to_skip) + ")";
  }
  return out;
}

inline policy::PolicyConfig parse(const std::string& yaml) {
  policy::PolicyConfig config;
  const auto issues = policy::parse_policy(yaml, "case.yaml", &config);
  std::string text;
  for (const auto& i : issues) text += i.format() + "\n";
  if (!issues.empty()) throw std::invalid_argument(text);
  return config;
}

}  // namespace testing_support
}  // namespace stepguard
