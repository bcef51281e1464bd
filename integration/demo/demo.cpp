#include "integration/demo/demo.h"

#include <signal.h>
#include <unistd.h>

#include <stepguard/stepguard.h>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "integration/demo/corpus.h"
#include "integration/demo/model.h"

namespace stepguard {
namespace demo {

namespace {

using Clock = std::chrono::steady_clock;

// Parameters the gradient faults land in: one in attention, one in an MLP.
constexpr const char* kNanGradParam = "blocks.1.qkv.weight";
constexpr const char* kInfGradParam = "blocks.0.fc_in.weight";
constexpr const char* kCorruptParam = "blocks.0.proj.weight";

// FNV-1a over the bytes of every parameter, in order: equal hashes mean bitwise-equal models.
std::uint64_t hash_parameters(const std::vector<torch::Tensor>& params) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const auto& p : params) {
    const auto c = p.detach().contiguous();
    const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
    const std::size_t n = c.numel() * c.element_size();
    for (std::size_t i = 0; i < n; ++i) {
      h ^= bytes[i];
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

std::string hex64(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, v);
  return buf;
}

nlohmann::json number_or_null(double v) {
  return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json();
}

bool injected(const DemoOptions& o, FaultKind kind, std::int64_t step) {
  for (const auto& inj : o.injections) {
    if (inj.kind == kind && inj.step == step) return true;
  }
  return false;
}

torch::Tensor& grad_of(torch::OrderedDict<std::string, torch::Tensor>& named, const char* name) {
  auto* p = named.find(name);
  TORCH_CHECK(p != nullptr, "demo: no parameter named ", name);
  auto& g = p->mutable_grad();
  TORCH_CHECK(g.defined(), "demo: parameter ", name, " has no gradient");
  return g;
}

// Live progress: one rewritten line on a terminal, a plain line every N steps otherwise.
class Progress {
 public:
  Progress(std::int64_t total, std::int64_t log_every)
      : total_(total), tty_(isatty(STDERR_FILENO) == 1) {
    every_ = log_every > 0 ? log_every : std::max<std::int64_t>(1, total / 10);
  }
  void update(const StepReport& r, double tokens_per_s, std::int64_t skipped) {
    const bool last = r.step == total_;
    if (tty_) {
      const auto now = Clock::now();
      if (!last && now - last_draw_ < std::chrono::milliseconds(100)) return;
      last_draw_ = now;
      std::fprintf(stderr,
                   "\r\033[K  step %6" PRId64 "/%" PRId64
                   "  loss %7.4f  %8.0f tok/s  skipped %" PRId64,
                   r.step, total_, r.loss, tokens_per_s, skipped);
      if (last) std::fputc('\n', stderr);
      std::fflush(stderr);
    } else if (r.step % every_ == 0 || last || r.step == 1) {
      std::fprintf(stderr,
                   "step %" PRId64 "/%" PRId64 " loss %.4f tok/s %.0f skipped %" PRId64 "\n",
                   r.step, total_, r.loss, tokens_per_s, skipped);
    }
  }
  void note(const std::string& line) {
    if (tty_) std::fputs("\r\033[K", stderr);
    std::fprintf(stderr, "%s\n", line.c_str());
  }

 private:
  std::int64_t total_;
  bool tty_;
  std::int64_t every_ = 1;
  Clock::time_point last_draw_{};
};

}  // namespace

int run_demo(const DemoOptions& o) {
  if (o.threads > 0) torch::set_num_threads(o.threads);
  torch::manual_seed(static_cast<std::uint64_t>(o.seed));
  const Corpus corpus = Corpus::load(o.corpus_dir);
  TORCH_CHECK(corpus.size() > o.context + 1, "demo: corpus is shorter than the context");

  ModelConfig mc;
  mc.vocab_size = corpus.vocab_size();
  mc.context = o.context;
  CharTransformer model(mc);
  auto named = model->named_parameters();
  torch::optim::AdamW adamw(model->parameters(),
                            torch::optim::AdamWOptions(o.lr).betas({0.9, 0.99}).weight_decay(0.01));
  GuardOptions guard_options = GuardOptions().trace_path(o.trace);
  if (!o.policy.empty()) {
    guard_options.policy_file(o.policy);
  } else {
    guard_options.max_consecutive_bad_steps(
        o.max_consecutive_bad_steps >= 0 ? o.max_consecutive_bad_steps : kDefaultMaxBadSteps);
  }
  stepguard::GuardedOptimizer guard(adamw, named, guard_options);

  std::int64_t num_params = 0;
  for (const auto& p : model->parameters()) num_params += p.numel();
  std::fprintf(stderr,
               "stepguard demo: %zu license files, %" PRId64 " characters, vocab %" PRId64
               ", %" PRId64 " parameters, %" PRId64 " steps of %" PRId64 "x%" PRId64 " tokens\n",
               corpus.num_files(), corpus.size(), corpus.vocab_size(), num_params, o.steps,
               o.batch_size, o.context);
  std::fprintf(stderr, "  %s\n", stepguard::build_info());

  Progress progress(o.steps, o.log_every);
  std::vector<double> applied_losses;
  double initial_loss = std::numeric_limits<double>::quiet_NaN();
  nlohmann::json incidents = nlohmann::json::array();
  std::int64_t batch_index = 0;  // the data position: batches consumed
  double tokens_per_s = 0.0;
  int exit_status = 0;
  const auto& tokens = corpus.tokens();

  for (std::int64_t step = 1; step <= o.steps; ++step) {
    const auto t0 = Clock::now();
    if (injected(o, FaultKind::kKill, step)) {
      progress.note("injected kill at step " + std::to_string(step));
      std::fflush(nullptr);
      raise(SIGKILL);
    }
    // Batch from the data position.
    const auto offsets = corpus.batch_offsets(o.seed, batch_index++, o.batch_size, o.context);
    auto input = torch::empty({o.batch_size, o.context}, torch::kLong);
    auto target = torch::empty({o.batch_size, o.context}, torch::kLong);
    auto* in_ptr = input.data_ptr<std::int64_t>();
    auto* tg_ptr = target.data_ptr<std::int64_t>();
    for (std::int64_t b = 0; b < o.batch_size; ++b) {
      for (std::int64_t t = 0; t < o.context; ++t) {
        in_ptr[b * o.context + t] = tokens[offsets[b] + t];
        tg_ptr[b * o.context + t] = tokens[offsets[b] + t + 1];
      }
    }

    if (injected(o, FaultKind::kCorruptWeights, step)) {
      torch::NoGradGuard no_grad;
      named.find(kCorruptParam)->view(-1)[0].fill_(std::nan(""));
    }
    const double saved_lr = adamw.param_groups()[0].options().get_lr();
    const bool lr_spike = injected(o, FaultKind::kLrSpike, step);
    if (lr_spike) {
      for (auto& g : adamw.param_groups()) g.options().set_lr(saved_lr * 1000.0);
    }

    adamw.zero_grad();
    const std::int64_t poison_row = injected(o, FaultKind::kNanInput, step) ? 0 : -1;
    auto logits = model->forward(input, poison_row);
    auto loss =
        torch::nn::functional::cross_entropy(logits.view({-1, mc.vocab_size}), target.view({-1}));
    if (injected(o, FaultKind::kNanLoss, step)) loss = loss * std::nan("");
    if (injected(o, FaultKind::kLossSpike, step)) loss = loss * 1000.0;
    loss.backward();
    if (injected(o, FaultKind::kNanGrad, step)) {
      grad_of(named, kNanGradParam).view(-1)[7].fill_(std::nan(""));
    }
    if (injected(o, FaultKind::kInfGrad, step)) {
      grad_of(named, kInfGradParam).view(-1)[3].fill_(std::numeric_limits<float>::infinity());
    }

    const StepReport report = guard.step(loss);
    if (lr_spike) {
      for (auto& g : adamw.param_groups()) g.options().set_lr(saved_lr);
    }
    batch_index += report.batches_to_skip;

    if (report.applied()) {
      if (std::isnan(initial_loss)) initial_loss = report.loss;
      applied_losses.push_back(report.loss);
    }
    if (report.incident) {
      const auto& inc = *report.incident;
      nlohmann::json j = {{"step", inc.step},    {"signal", inc.signal},   {"action", inc.action},
                          {"cause", inc.cause},  {"tensors", inc.tensors}, {"ranks", inc.ranks},
                          {"reason", inc.reason}};
      incidents.push_back(j);
      std::string blamed;
      for (const auto& t : inc.tensors) blamed += (blamed.empty() ? "" : ", ") + t;
      progress.note("  step " + std::to_string(inc.step) + ": " + inc.signal + " -> " + inc.action +
                    (blamed.empty() ? "" : " (" + blamed + ")"));
    }
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    const double rate = static_cast<double>(o.batch_size * o.context) / std::max(dt, 1e-9);
    tokens_per_s = tokens_per_s == 0.0 ? rate : 0.9 * tokens_per_s + 0.1 * rate;
    progress.update(report, tokens_per_s, guard.totals().skipped);
    if (report.aborted()) {
      progress.note("stepguard aborted training at step " + std::to_string(report.step) + ": " +
                    report.incident.value_or(Incident{}).reason);
      exit_status = 3;
      break;
    }
  }

  // Summary.
  const GuardTotals totals = guard.totals();
  const std::size_t tail = std::min<std::size_t>(10, applied_losses.size());
  double final_loss = std::numeric_limits<double>::quiet_NaN();
  if (tail > 0) {
    double sum = 0.0;
    for (std::size_t i = applied_losses.size() - tail; i < applied_losses.size(); ++i) {
      sum += applied_losses[i];
    }
    final_loss = sum / static_cast<double>(tail);
  }
  bool params_finite = true;
  for (const auto& p : model->parameters()) {
    params_finite = params_finite && torch::isfinite(p).all().item<bool>();
  }
  const std::string param_hash = hex64(hash_parameters(model->parameters()));

  nlohmann::json summary = {
      {"steps", totals.steps},
      {"applied", totals.applied},
      {"skipped", totals.skipped},
      {"rollbacks", 0},
      {"aborted", totals.aborted > 0},
      {"initial_loss", number_or_null(initial_loss)},
      {"final_loss", number_or_null(final_loss)},
      {"params_finite", params_finite},
      {"param_hashes", {param_hash}},
      {"loss_scale", 1.0},
      {"lr_factor", 1.0},
      {"ranks", o.ranks},
      {"seed", o.seed},
      {"collectives", guard.collectives()},
      {"batches_consumed", batch_index},
      {"incidents", incidents},
  };
  if (!o.summary_json.empty()) {
    std::ofstream out(o.summary_json);
    out << summary.dump(2) << '\n';
    if (!out) throw std::runtime_error("demo: cannot write summary to '" + o.summary_json + "'");
  }

  std::ostringstream table;
  table << "\nstepguard demo summary\n";
  char line[256];
  auto row = [&](const char* key, const std::string& value) {
    std::snprintf(line, sizeof line, "  %-16s %s\n", key, value.c_str());
    table << line;
  };
  row("steps", std::to_string(totals.steps) + " of " + std::to_string(o.steps));
  row("applied", std::to_string(totals.applied));
  row("skipped", std::to_string(totals.skipped));
  row("aborted", totals.aborted > 0 ? "yes" : "no");
  std::snprintf(line, sizeof line, "%.4f -> %.4f (%+.1f%%)", initial_loss, final_loss,
                100.0 * (final_loss / initial_loss - 1.0));
  row("loss", line);
  row("params finite", params_finite ? "yes" : "NO");
  row("param hash", param_hash);
  row("collectives", std::to_string(guard.collectives()) + " (one per step)");
  if (!incidents.empty()) {
    table << "  incidents\n";
    std::snprintf(line, sizeof line, "    %-6s %-16s %-12s %-8s %s\n", "step", "signal", "action",
                  "cause", "tensors");
    table << line;
    for (const auto& inc : incidents) {
      std::string tensors;
      for (const auto& t : inc["tensors"])
        tensors += (tensors.empty() ? "" : ",") + t.get<std::string>();
      std::snprintf(line, sizeof line, "    %-6" PRId64 " %-16s %-12s %-8s %s\n",
                    inc["step"].get<std::int64_t>(), inc["signal"].get<std::string>().c_str(),
                    inc["action"].get<std::string>().c_str(),
                    inc["cause"].get<std::string>().c_str(), tensors.c_str());
      table << line;
    }
  }
  if (!o.summary_json.empty()) row("summary json", o.summary_json);
  if (!o.trace.empty()) row("trace", o.trace);
  std::cout << table.str() << std::flush;
  return exit_status;
}

}  // namespace demo
}  // namespace stepguard
