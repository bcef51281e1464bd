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
         "                      [--policy FILE | --max-bad-steps N] [--log-every N] [--corpus "
         "DIR]\n"
         "                      [--checkpoint-dir DIR] [--checkpoint-every N] [--resume DIR]\n"
         "                      [--incident-dir DIR] [--probe]\n"
         "\n"
         "Trains a small character-level transformer on /usr/share/common-licenses under\n"
         "stepguard, injecting the faults asked for, and prints a summary.\n"
         "KIND: nan_grad inf_grad nan_loss nan_input overflow lr_spike loss_spike\n"
         "      corrupt_weights drift_weights kill kill_early transient_nan\n"
         "With --ranks R > 1, R processes train data-parallel over Gloo on 127.0.0.1;\n"
         "KIND@STEP:RANK injects on one rank only. Under torchrun (RANK and WORLD_SIZE set)\n"
         "each process is one rank.\n"
         "Without --policy the demo runs configs/policies/default.yaml (built in);\n"
         "--max-bad-steps N runs the plain ladder instead: skip, abort after N in a row.\n"
         "--checkpoint-dir DIR writes a checkpoint every N steps (default 50); --resume DIR\n"
         "continues from the newest valid one there (and keeps writing there).\n"
         "--probe wraps every block's output and the logits in forensics probes: an incident\n"
         "names the first bad block forward and backward (one device read per probe and step).\n"
         "Exit status: 0 trained to the end, 2 bad arguments, 3 the policy aborted, 1 error.\n";
}

std::optional<DemoOptions> parse_demo_args(const std::vector<std::string>& args, std::string* error,
                                           bool* help) {
  DemoOptions o;
  o.raw_args = args;
  *help = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i];
    std::string value;
    bool has_inline_value = false;
    if (const auto eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_inline_value = true;
    }
    if (flag == "--help" || flag == "-h") {
      *help = true;
      *error = demo_usage();
      return std::nullopt;
    }
    auto take_value = [&]() -> bool {
      if (has_inline_value) return true;
      if (i + 1 >= args.size()) {
        *error = flag + ": missing value";
        return false;
      }
      value = args[++i];
      return true;
    };
    auto bad = [&](const std::string& what) {
      *error = flag + " '" + value + "': " + what;
      return std::nullopt;
    };
    std::int64_t n = 0;
    if (flag == "--steps") {
      if (!take_value()) return std::nullopt;
      if (!parse_int(value, 1, 100000000, &n)) return bad("expected a whole number >= 1");
      o.steps = n;
    } else if (flag == "--seed") {
      if (!take_value()) return std::nullopt;
      if (!parse_int(value, 0, std::numeric_limits<std::int64_t>::max(), &n)) {
        return bad("expected a whole number >= 0");
      }
      o.seed = static_cast<std::uint64_t>(n);
    } else if (flag == "--ranks") {
      if (!take_value()) return std::nullopt;
      if (!parse_int(value, 1, 64, &n)) return bad("expected a whole number in [1, 64]");
      o.ranks = static_cast<int>(n);
    } else if (flag == "--inject") {
      if (!take_value()) return std::nullopt;
      auto inj = parse_injection(value, error);
      if (!inj) return std::nullopt;
      o.injections.push_back(*inj);
    } else if (flag == "--summary-json") {
      if (!take_value()) return std::nullopt;
      if (value.empty()) return bad("expected a file path");
      o.summary_json = value;
    } else if (flag == "--checkpoint-dir") {
      if (!take_value()) return std::nullopt;
      if (value.empty()) return bad("expected a directory");
      o.checkpoint_dir = value;
    } else if (flag == "--checkpoint-every") {
      if (!take_value()) return std::nullopt;
      if (!parse_int(value, 1, 100000000, &n)) return bad("expected a whole number >= 1");
      o.checkpoint_every = n;
    } else if (flag == "--incident-dir") {
      if (!take_value()) return std::nullopt;
      if (value.empty()) return bad("expected a directory");
      o.incident_dir = value;
    } else if (flag == "--resume") {
      if (!take_value()) return std::nullopt;
      if (value.empty()) return bad("expected a directory");
      o.resume = value;
    } else if (flag == "--trace") {
      if (!take_value()) return std::nullopt;
      if (value.empty()) return bad("expected a file path");
      o.trace = value;
    } else if (flag == "--corpus") {
      if (!take_value()) return std::nullopt;
      o.corpus_dir = value;
    } else if (flag == "--batch-size") {
      if (!take_value()) return std::nullopt;
      if (!parse_int(value, 1, 4096, &n)) return bad("expected a whole number in [1, 4096]");
      o.batch_size = n;
    } else if (flag == "--context") {
      if (!take_value()) return std::nullopt;
      if (!parse_int(value, 2, 1024, &n)) return bad("expected a whole number in [2, 1024]");
      o.context = n;
    } else if (flag == "--lr") {
      if (!take_value()) return std::nullopt;
      double lr = 0;
      if (!parse_double(value, &lr) || lr <= 0 || lr > 1) return bad("expected a number in (0, 1]");
      o.lr = lr;
    } else if (flag == "--threads") {
      if (!take_value()) return std::nullopt;
      if (!parse_int(value, 0, 1024, &n)) return bad("expected a whole number in [0, 1024]");
      o.threads = static_cast<int>(n);
    } else if (flag == "--max-bad-steps") {
      if (!take_value()) return std::nullopt;
      if (!parse_int(value, 0, 100000000, &n)) return bad("expected a whole number >= 0");
      o.max_consecutive_bad_steps = n;
    } else if (flag == "--collective-timeout") {
      if (!take_value()) return std::nullopt;
      if (!parse_int(value, 1, 86400, &n)) return bad("expected whole seconds in [1, 86400]");
      o.collective_timeout_s = n;
    } else if (flag == "--log-every") {
      if (!take_value()) return std::nullopt;
      if (!parse_int(value, 0, 100000000, &n)) return bad("expected a whole number >= 0");
      o.log_every = n;
    } else if (flag == "--policy") {
      if (!take_value()) return std::nullopt;
      if (value.empty()) return bad("expected a file path");
      o.policy = value;
    } else if (flag == "--metrics-port") {
      if (!take_value()) return std::nullopt;
      if (!parse_int(value, 0, 65535, &n)) return bad("expected a TCP port in [0, 65535]");
      o.metrics_port = static_cast<int>(n);
    } else if (flag == "--probe") {
      if (has_inline_value) return bad("takes no value");
      o.probe = true;
    } else if (flag == "--linger") {
      if (!take_value()) return std::nullopt;
      if (!parse_int(value, 0, 86400, &n)) return bad("expected whole seconds in [0, 86400]");
      o.linger_s = n;
    } else if (flag == "--precision") {
      if (!take_value()) return std::nullopt;
      if (value != "fp32" && value != "fp16") return bad("expected fp32 or fp16");
      o.fp16 = value == "fp16";
    } else if (flag == "--run-name") {
      if (!take_value()) return std::nullopt;
      if (value.empty()) return bad("expected a name");
      o.run_name = value;
    } else if (flag == "--checkpoint-dir") {
      *error = flag + ": not available in this build yet (arrives with the checkpoint work)";
      return std::nullopt;
    } else {
      *error = "unknown flag '" + flag + "' (see stepguard demo --help)";
      return std::nullopt;
    }
  }
  if (!o.policy.empty() && o.max_consecutive_bad_steps >= 0) {
    *error = "--max-bad-steps: the policy file '" + o.policy +
             "' sets the limits; give one or the other";
    return std::nullopt;
  }
  for (const auto& inj : o.injections) {
    if (inj.kind == FaultKind::kOverflow && !o.fp16) {
      *error = "--inject overflow: needs --precision fp16 (an fp16 overflow needs fp16 gradients)";
      return std::nullopt;
    }
  }
  return o;
}

}  // namespace demo
}  // namespace stepguard
