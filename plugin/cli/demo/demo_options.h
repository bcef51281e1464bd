/*
 * The demo training job's options and the parsing of its command line. Torch-free, so the CLI and
 * its tests stay cheap to build.
 */
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace stepguard {
namespace demo {

/// Faults the demo can inject, by their command-line names.
enum class FaultKind {
  kNanGrad,         ///< one gradient element becomes NaN after backward
  kInfGrad,         ///< one gradient element becomes +Inf after backward
  kNanLoss,         ///< the loss is multiplied by NaN before backward (every gradient NaN)
  kNanInput,        ///< one sequence of the batch's input embeddings becomes NaN
  kOverflow,        ///< fp16 overflow (needs fp16 emulation)
  kLrSpike,         ///< the learning rate is multiplied by 1000 for one step
  kLossSpike,       ///< the loss (and so every gradient) is multiplied by 1000 for one step
  kCorruptWeights,  ///< one parameter element becomes NaN before the forward pass
  kDriftWeights,    ///< one parameter element moves by a finite amount (a replica drifts)
  kKill,            ///< the process dies abruptly (SIGKILL) at that step, before the guard's step
  kKillEarly,       ///< the same, before the gradient average (the others fail in that)
  kTransientNan,    ///< a NaN gradient in the step's first execution only (a replay is clean)
};

const char* to_string(FaultKind kind) noexcept;

/// KIND@STEP[:RANK]; rank -1 means every rank.
struct Injection {
  FaultKind kind = FaultKind::kNanGrad;
  std::int64_t step = 0;
  int rank = -1;
};

/// Parses "KIND@STEP[:RANK]". Returns the error text (naming the flag value) on failure.
std::optional<Injection> parse_injection(const std::string& text, std::string* error);

/// Everything `stepguard demo` takes.
struct DemoOptions {
  std::int64_t steps = 300;
  std::uint64_t seed = 1234;
  int ranks = 1;
  std::vector<Injection> injections;
  std::string summary_json;
  std::string trace;
  std::string checkpoint_dir;          ///< disk checkpoints; empty: none (unless --resume)
  std::int64_t checkpoint_every = 50;  ///< steps between disk checkpoints
  std::string resume;                  ///< resume from the newest valid checkpoint here
  std::string incident_dir;            ///< incident reports; empty: none
  std::string corpus_dir = "/usr/share/common-licenses";
  /// The default corpus: only the license texts Debian 12 and 13 ship alike (corpus.h); --corpus
  /// DIR reads every file of DIR instead.
  bool stable_corpus = true;
  std::int64_t batch_size = 32;
  std::int64_t context = 64;
  double lr = 1e-3;    ///< 2e-3 is past this model's stability edge: a grad-norm spike near step 10
  int threads = 0;     ///< 0: every CPU for one rank, one per rank for several
  std::string policy;  ///< policy file; empty: the built-in default.yaml (or --max-bad-steps)
  /// >= 0: the built-in ladder (skip, abort after this many bad steps in a row) instead of the
  /// default policy; -1: not given on the command line.
  std::int64_t max_consecutive_bad_steps = -1;
  std::int64_t log_every = 0;  ///< plain progress lines every N steps off a terminal; 0 = auto
  std::int64_t collective_timeout_s = 300;  ///< deadline of every collective between ranks
  int metrics_port = -1;          ///< -1 none; 0 any free port; P: rank r serves on P + local rank
  std::int64_t linger_s = 0;      ///< keep serving metrics this long after training ends
  std::string run_name = "demo";  ///< the `run` label on metrics
  bool fp16 = false;   ///< --precision fp16: loss scaling, gradients stored in fp16 after backward
  bool probe = false;  ///< --probe: forensics probes on every block's output and the logits
  std::vector<std::string> raw_args;  ///< the arguments as given, for launching ranks
};

/// Parses the arguments after "demo". On error returns nullopt and sets `error` to one line that
/// names the flag. `--help` sets `error` to the usage text and `help` to true.
std::optional<DemoOptions> parse_demo_args(const std::vector<std::string>& args, std::string* error,
                                           bool* help);

/// The usage text of `stepguard demo`.
const char* demo_usage() noexcept;

}  // namespace demo
}  // namespace stepguard
