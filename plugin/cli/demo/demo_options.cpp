#include "plugin/cli/demo/demo_options.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>

namespace stepguard {
namespace demo {

namespace {

struct KindName {
  FaultKind kind;
  const char* name;
};
constexpr KindName kKinds[] = {
    {FaultKind::kNanGrad, "nan_grad"},           {FaultKind::kInfGrad, "inf_grad"},
    {FaultKind::kNanLoss, "nan_loss"},           {FaultKind::kNanInput, "nan_input"},
    {FaultKind::kOverflow, "overflow"},          {FaultKind::kLrSpike, "lr_spike"},
    {FaultKind::kLossSpike, "loss_spike"},       {FaultKind::kCorruptWeights, "corrupt_weights"},
    {FaultKind::kDriftWeights, "drift_weights"}, {FaultKind::kKill, "kill"},
    {FaultKind::kKillEarly, "kill_early"},       {FaultKind::kTransientNan, "transient_nan"},
};

bool parse_int(const std::string& s, std::int64_t lo, std::int64_t hi, std::int64_t* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size() || v < lo || v > hi) return false;
  *out = v;
  return true;
}

bool parse_double(const std::string& s, double* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || end != s.c_str() + s.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

}  // namespace

const char* to_string(FaultKind kind) noexcept {
  for (const auto& k : kKinds) {
    if (k.kind == kind) return k.name;
  }
  return "unknown";
}

std::optional<Injection> parse_injection(const std::string& text, std::string* error) {
  const auto at = text.find('@');
  std::string kinds;
  for (const auto& k : kKinds) kinds += std::string(kinds.empty() ? "" : " ") + k.name;
  if (at == std::string::npos) {
    *error = "--inject '" + text + "': expected KIND@STEP[:RANK], KIND one of: " + kinds;
    return std::nullopt;
  }
  const std::string kind = text.substr(0, at);
  Injection inj;
  bool known = false;
  for (const auto& k : kKinds) {
    if (kind == k.name) {
      inj.kind = k.kind;
      known = true;
    }
  }
  if (!known) {
    *error =
        "--inject '" + text + "': unknown fault kind '" + kind + "'; expected one of: " + kinds;
    return std::nullopt;
  }
  std::string rest = text.substr(at + 1);
  std::string rank_text;
  if (const auto colon = rest.find(':'); colon != std::string::npos) {
    rank_text = rest.substr(colon + 1);
    rest = rest.substr(0, colon);
  }
  std::int64_t step = 0;
  if (!parse_int(rest, 1, std::numeric_limits<std::int64_t>::max(), &step)) {
    *error = "--inject '" + text + "': step '" + rest + "' is not a whole number >= 1";
    return std::nullopt;
  }
  inj.step = step;
  if (!rank_text.empty() || text.find(':') != std::string::npos) {
    std::int64_t rank = 0;
    if (!parse_int(rank_text, 0, 1 << 20, &rank)) {
      *error = "--inject '" + text + "': rank '" + rank_text + "' is not a whole number >= 0";
      return std::nullopt;
    }
    inj.rank = static_cast<int>(rank);
  }
  return inj;
}

const char* demo_usage() noexcept {
  return "usage: stepguard demo [--steps N] [--seed S] [--inject KIND@STEP[:RANK]]...\n"
         "                      [--summary-json FILE] [--trace FILE] [--ranks R]\n"
         "                      [--collective-timeout SECONDS] [--metrics-port P] [--linger S]\n"
         "                      [--run-name NAME] [--precision fp32|fp16]\n"
         "                      [--batch-size B] [--context T] [--lr LR] [--threads N]\n"
         "                      [--policy POLICY | --max-bad-steps N] [--log-every N]\n"
         "                      [--corpus DIR]\n"
         "                      [--checkpoint-dir DIR] [--checkpoint-every N] [--resume DIR]\n"
         "                      [--incident-dir DIR] [--probe]\n"
         "\n"
         "Trains a small character-level transformer under stepguard, injecting the faults\n"
         "asked for, and prints a summary. The text: the licenses in /usr/share/common-licenses\n"
         "that Debian 12 and 13 ship alike (the same run on both); --corpus DIR reads every\n"
         "file of DIR instead.\n"
         "KIND: nan_grad inf_grad nan_loss nan_input overflow lr_spike loss_spike\n"
         "      corrupt_weights drift_weights kill kill_early transient_nan\n"
         "With --ranks R > 1, R processes train data-parallel over Gloo on 127.0.0.1;\n"
         "KIND@STEP:RANK injects on one rank only. Under torchrun (RANK and WORLD_SIZE set)\n"
         "each process is one rank.\n"
         "--policy takes a YAML file or a shipped preset's name (stepguard policy list);\n"
         "without it the demo runs the 'default' preset.\n"
         "--max-bad-steps N runs the plain ladder instead: skip, abort after N in a row.\n"
         "--checkpoint-dir DIR writes a checkpoint every N steps (default 50); --resume DIR\n"
         "continues from the newest valid one there (and keeps writing there).\n"
         "--probe wraps every block's output and the logits in forensics probes: an incident\n"
         "names the first bad block forward and backward (one device read per probe and step).\n"
         "--threads N: torch threads per rank (default: OMP_NUM_THREADS when set, else\n"
         "every CPU with one rank and 1 per rank with several).\n"
         "Exit status: 0 trained to the end, 2 bad arguments, 3 the policy aborted, 1 error.\n";
}

namespace {

// What a flag with a value does with it: nullptr once applied, else why the value is bad (the text
// after "FLAG 'VALUE': ").
using ApplyValue = const char* (*)(const std::string& value, DemoOptions& o);

struct ValueFlag {
  const char* name;
  ApplyValue apply;
};

// A whole number in [lo, hi] into `out`; `what` is the reason when it is not one.
template <typename T>
const char* whole(const std::string& value, std::int64_t lo, std::int64_t hi, const char* what,
                  T* out) {
  std::int64_t n = 0;
  if (!parse_int(value, lo, hi, &n)) return what;
  *out = static_cast<T>(n);
  return nullptr;
}

// A non-empty text into `out`; `what` is the reason when it is empty.
const char* non_empty(const std::string& value, const char* what, std::string* out) {
  if (value.empty()) return what;
  *out = value;
  return nullptr;
}

constexpr const char* kAtLeastOne = "expected a whole number >= 1";
constexpr const char* kAtLeastZero = "expected a whole number >= 0";
constexpr const char* kFilePath = "expected a file path";
constexpr const char* kDirectory = "expected a directory";
constexpr std::int64_t kMaxSteps = 100000000;

// Every flag that takes a value, except --inject (its parser words its own errors).
const ValueFlag kValueFlags[] = {
    {"--steps", [](const std::string& v,
                   DemoOptions& o) { return whole(v, 1, kMaxSteps, kAtLeastOne, &o.steps); }},
    {"--seed",
     [](const std::string& v, DemoOptions& o) {
       return whole(v, 0, std::numeric_limits<std::int64_t>::max(), kAtLeastZero, &o.seed);
     }},
    {"--ranks",
     [](const std::string& v, DemoOptions& o) {
       return whole(v, 1, 64, "expected a whole number in [1, 64]", &o.ranks);
     }},
    {"--summary-json",
     [](const std::string& v, DemoOptions& o) { return non_empty(v, kFilePath, &o.summary_json); }},
    {"--checkpoint-dir",
     [](const std::string& v, DemoOptions& o) {
       return non_empty(v, kDirectory, &o.checkpoint_dir);
     }},
    {"--checkpoint-every",
     [](const std::string& v, DemoOptions& o) {
       return whole(v, 1, kMaxSteps, kAtLeastOne, &o.checkpoint_every);
     }},
    {"--incident-dir", [](const std::string& v,
                          DemoOptions& o) { return non_empty(v, kDirectory, &o.incident_dir); }},
    {"--resume",
     [](const std::string& v, DemoOptions& o) { return non_empty(v, kDirectory, &o.resume); }},
    {"--trace",
     [](const std::string& v, DemoOptions& o) { return non_empty(v, kFilePath, &o.trace); }},
    {"--corpus",
     [](const std::string& v, DemoOptions& o) -> const char* {
       o.corpus_dir = v;
       o.stable_corpus = false;
       return nullptr;
     }},
    {"--batch-size",
     [](const std::string& v, DemoOptions& o) {
       return whole(v, 1, 4096, "expected a whole number in [1, 4096]", &o.batch_size);
     }},
    {"--context",
     [](const std::string& v, DemoOptions& o) {
       return whole(v, 2, 1024, "expected a whole number in [2, 1024]", &o.context);
     }},
    {"--lr",
     [](const std::string& v, DemoOptions& o) -> const char* {
       double lr = 0;
       if (!parse_double(v, &lr) || lr <= 0 || lr > 1) return "expected a number in (0, 1]";
       o.lr = lr;
       return nullptr;
     }},
    {"--threads",
     [](const std::string& v, DemoOptions& o) {
       return whole(v, 0, 1024, "expected a whole number in [0, 1024]", &o.threads);
     }},
    {"--max-bad-steps",
     [](const std::string& v, DemoOptions& o) {
       return whole(v, 0, kMaxSteps, kAtLeastZero, &o.max_consecutive_bad_steps);
     }},
    {"--collective-timeout",
     [](const std::string& v, DemoOptions& o) {
       return whole(v, 1, 86400, "expected whole seconds in [1, 86400]", &o.collective_timeout_s);
     }},
    {"--log-every",
     [](const std::string& v, DemoOptions& o) {
       return whole(v, 0, kMaxSteps, kAtLeastZero, &o.log_every);
     }},
    {"--policy",
     [](const std::string& v, DemoOptions& o) { return non_empty(v, kFilePath, &o.policy); }},
    {"--metrics-port",
     [](const std::string& v, DemoOptions& o) {
       return whole(v, 0, 65535, "expected a TCP port in [0, 65535]", &o.metrics_port);
     }},
    {"--linger",
     [](const std::string& v, DemoOptions& o) {
       return whole(v, 0, 86400, "expected whole seconds in [0, 86400]", &o.linger_s);
     }},
    {"--precision",
     [](const std::string& v, DemoOptions& o) -> const char* {
       if (v != "fp32" && v != "fp16") return "expected fp32 or fp16";
       o.fp16 = v == "fp16";
       return nullptr;
     }},
    {"--run-name", [](const std::string& v,
                      DemoOptions& o) { return non_empty(v, "expected a name", &o.run_name); }},
};

const ValueFlag* find_value_flag(const std::string& flag) {
  for (const auto& f : kValueFlags) {
    if (flag == f.name) return &f;
  }
  return nullptr;
}

// Splits "--flag=value" into `flag` and `value`; returns whether there was an inline value.
bool split_inline_value(std::string* flag, std::string* value) {
  const auto eq = flag->find('=');
  if (flag->rfind("--", 0) != 0 || eq == std::string::npos) return false;
  *value = flag->substr(eq + 1);
  flag->resize(eq);
  return true;
}

// The checks across flags, once every flag is read.
bool check_combinations(const DemoOptions& o, std::string* error) {
  if (!o.policy.empty() && o.max_consecutive_bad_steps >= 0) {
    *error = "--max-bad-steps: the policy file '" + o.policy +
             "' sets the limits; give one or the other";
    return false;
  }
  for (const auto& inj : o.injections) {
    if (inj.kind == FaultKind::kOverflow && !o.fp16) {
      *error = "--inject overflow: needs --precision fp16 (an fp16 overflow needs fp16 gradients)";
      return false;
    }
  }
  return true;
}

}  // namespace

std::optional<DemoOptions> parse_demo_args(const std::vector<std::string>& args, std::string* error,
                                           bool* help) {
  DemoOptions o;
  o.raw_args = args;
  *help = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i];
    std::string value;
    const bool has_inline_value = split_inline_value(&flag, &value);
    if (flag == "--help" || flag == "-h") {
      *help = true;
      *error = demo_usage();
      return std::nullopt;
    }
    if (flag == "--probe") {
      if (has_inline_value) {
        *error = flag + " '" + value + "': takes no value";
        return std::nullopt;
      }
      o.probe = true;
      continue;
    }
    const ValueFlag* value_flag = find_value_flag(flag);
    if (value_flag == nullptr && flag != "--inject") {
      *error = "unknown flag '" + flag + "' (see stepguard demo --help)";
      return std::nullopt;
    }
    if (!has_inline_value) {
      if (i + 1 >= args.size()) {
        *error = flag + ": missing value";
        return std::nullopt;
      }
      value = args[++i];
    }
    if (value_flag == nullptr) {  // --inject
      auto inj = parse_injection(value, error);
      if (!inj) return std::nullopt;
      o.injections.push_back(*inj);
    } else if (const char* why = value_flag->apply(value, o)) {
      *error = flag + " '" + value + "': " + why;
      return std::nullopt;
    }
  }
  if (!check_combinations(o, error)) return std::nullopt;
  return o;
}

}  // namespace demo
}  // namespace stepguard
