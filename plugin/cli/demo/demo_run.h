/*
 * One run of `stepguard demo` in this process (one rank), internal to the demo: the world it
 * joined, the model, the optimizer and its guard, and what the run has recorded so far. Its
 * phases live in demo.cpp (set-up, the training step, recording), demo_faults.cpp (the injected
 * faults) and demo_summary.cpp (the summary JSON and table). Not here: launching several ranks
 * (launcher.h), the command line (demo_options.h), the live progress line (progress.h).
 */
#pragma once

#include <torch/torch.h>

#include <stepguard/stepguard.h>
#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "plugin/cli/demo/corpus.h"
#include "plugin/cli/demo/demo_options.h"
#include "plugin/cli/demo/model.h"
#include "plugin/cli/demo/progress.h"

namespace stepguard {
namespace demo {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ull;

/// Folds `n` bytes into the FNV-1a hash `h`.
std::uint64_t fnv1a(std::uint64_t h, const void* data, std::size_t n);

/// Where this process stands in a multi-rank run.
struct World {
  int rank = 0;
  int local_rank = 0;
  int size = 1;
  ProcessGroupHandle group;  // empty for one rank
};

/// What the ranks' end-of-run values say together (the lead rank's view, after the gathers).
struct RankAgreement {
  nlohmann::json param_hashes = nlohmann::json::array();
  bool hashes_equal = true;
  bool outcomes_agree = true;
  bool params_finite = true;
};

/// One demo run. Not thread-safe: one run per process, driven by run_demo.
class DemoRun {
 public:
  explicit DemoRun(const DemoOptions& options);

  /// Sets up, resumes if asked, trains and summarizes. Returns the process exit status.
  int run();

 private:
  // Set-up (demo.cpp).
  void join_world();
  void check_injection_ranks() const;
  void set_threads() const;
  void build_model();
  GuardOptions guard_options() const;
  void build_guard();
  void print_banner() const;
  void resume();

  // Training (demo.cpp).
  bool train_step(std::int64_t step);  // false once the policy aborted
  void load_batch();
  void set_lr(double lr);
  torch::Tensor forward_backward(ReplayMode mode, bool check_inputs);
  void average_gradients_or_exit();
  StepReport guarded_step(const torch::Tensor& loss);
  bool record_step(const StepReport& report, Clock::time_point started);
  void record_incident(const Incident& inc);

  // Injected faults (demo_faults.cpp).
  bool injected(FaultKind kind) const;
  void inject_weight_faults();
  void inject_gradient_faults();
  void inject_transient_fault();
  void die_if_injected(FaultKind kind);

  // Summary (demo_summary.cpp).
  int finish();
  double tail_mean_loss() const;
  void linger() const;
  nlohmann::json summary_json(const GuardTotals& totals, double final_loss,
                              const RankAgreement& agreement) const;
  void write_summary(const nlohmann::json& summary) const;
  void print_summary_table(const GuardTotals& totals, double final_loss,
                           const RankAgreement& agreement, const std::string& pictures) const;

  const DemoOptions& o_;
  World world_;
  bool lead_ = true;
  std::optional<Corpus> corpus_;
  ModelConfig mc_;
  CharTransformer model_{nullptr};
  torch::OrderedDict<std::string, torch::Tensor> named_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<torch::optim::AdamW> adamw_;
  std::unique_ptr<GuardedOptimizer> guard_;
  Progress progress_;

  // What the run has recorded so far.
  std::vector<double> applied_losses_;
  double initial_loss_ = std::numeric_limits<double>::quiet_NaN();
  nlohmann::json incidents_ = nlohmann::json::array();
  std::int64_t batch_index_ = 0;  // the data position: batches consumed (per rank)
  double tokens_per_s_ = 0.0;
  int exit_status_ = 0;
  std::uint64_t outcome_digest_ = kFnvOffset;  // FNV-1a over every step's outcome
  std::int64_t first_step_ = 1;

  // The step in progress: the guard's forensics replay runs its forward and backward again.
  std::int64_t step_ = 0;
  torch::Tensor input_, target_;
  std::int64_t poison_row_ = -1;
};

}  // namespace demo
}  // namespace stepguard
