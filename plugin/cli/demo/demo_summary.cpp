// The end of a demo run: what every rank contributes (parameter hashes, outcome digests), the
// summary JSON a script reads and the table a person reads.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "csrc/common/json_text.h"
#include "csrc/common/safe_file.h"
#include "plugin/cli/demo/demo_run.h"
#include "plugin/cli/demo/pictures.h"

namespace stepguard {
namespace demo {

namespace {

constexpr const char* kDefaultPolicyName = "configs/policies/default.yaml (built in)";

// FNV-1a over the bytes of every parameter, in order: equal hashes mean bitwise-equal models.
std::uint64_t hash_parameters(const std::vector<torch::Tensor>& params) {
  std::uint64_t h = kFnvOffset;
  for (const auto& p : params) {
    const auto c = p.detach().contiguous();
    h = fnv1a(h, c.data_ptr(), c.numel() * c.element_size());
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

// Every rank's value of `v`, in rank order (one all-gather, after training).
std::vector<std::uint64_t> gather_u64(std::uint64_t v, const World& world) {
  if (world.size == 1) return {v};
  std::vector<torch::Tensor> input{torch::tensor({static_cast<std::int64_t>(v)}, torch::kLong)};
  std::vector<std::vector<torch::Tensor>> output(1);
  for (int r = 0; r < world.size; ++r) output[0].push_back(torch::zeros({1}, torch::kLong));
  world.group.group->allgather(output, input)->wait();
  std::vector<std::uint64_t> values;
  for (const auto& t : output[0])
    values.push_back(static_cast<std::uint64_t>(t.item<std::int64_t>()));
  return values;
}

RankAgreement agreement_of(const std::vector<std::uint64_t>& hashes,
                           const std::vector<std::uint64_t>& outcome_digests,
                           const std::vector<std::uint64_t>& finite_flags, bool params_finite) {
  RankAgreement a;
  a.params_finite = params_finite;
  for (std::size_t r = 0; r < hashes.size(); ++r) {
    a.param_hashes.push_back(hex64(hashes[r]));
    a.hashes_equal = a.hashes_equal && hashes[r] == hashes[0];
    a.outcomes_agree = a.outcomes_agree && outcome_digests[r] == outcome_digests[0];
    a.params_finite = a.params_finite && finite_flags[r] == 1;
  }
  return a;
}

// The summary table's incident rows: the first tensors blamed, and each origin rank with the
// cause it found. Each column as wide as its widest cell, two spaces apart (as `column -t`).
void write_incident_rows(std::ostringstream& table, const nlohmann::json& incidents,
                         int world_size) {
  std::vector<std::vector<std::string>> rows = {
      {"step", "signal", "action", "cause", "ranks", "tensors"}};
  for (const auto& inc : incidents) {
    std::string tensors, ranks;
    for (std::size_t i = 0; i < inc["tensors"].size() && i < 2; ++i) {
      tensors += (i ? "," : "") + inc["tensors"][i].get<std::string>();
    }
    if (inc["tensors"].size() > 2) {
      tensors += " (+" + std::to_string(inc["tensors"].size() - 2) + " more)";
    }
    // Each origin rank with the cause it found, when the ranks agreed on causes.
    for (const auto& r : inc["ranks"]) {
      const std::string key = std::to_string(r.get<int>());
      ranks += (ranks.empty() ? "" : ",") + key;
      if (world_size > 1 && inc["rank_causes"].contains(key)) {
        ranks += ":" + inc["rank_causes"][key].get<std::string>();
      }
    }
    rows.push_back({std::to_string(inc["step"].get<std::int64_t>()),
                    inc["signal"].get<std::string>(), inc["action"].get<std::string>(),
                    inc["cause"].get<std::string>(), ranks.empty() ? "-" : ranks, tensors});
  }
  std::vector<std::size_t> width(rows.front().size(), 0);
  for (const auto& row : rows) {
    for (std::size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  table << "  incidents\n";
  for (const auto& row : rows) {
    std::string line = "    ";
    for (std::size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 2, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    table << line << "\n";
  }
}

}  // namespace

std::uint64_t fnv1a(std::uint64_t h, const void* data, std::size_t n) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ bytes[i]) * 0x100000001b3ull;
  return h;
}

// Hashes and outcome digests come from every rank: equal values mean the replicas stayed bitwise
// identical and decided identically on every step.
int DemoRun::finish() {
  GuardedOptimizer& guard = *guard_;
  guard.set_replay({});   // it refers to the step in progress
  model_->set_probe({});  // so does the probe

  const GuardTotals totals = guard.stats().totals;
  const double final_loss = tail_mean_loss();
  bool params_finite = true;
  for (const auto& p : params_)
    params_finite = params_finite && torch::isfinite(p).all().item<bool>();
  linger();
  const auto hashes = gather_u64(hash_parameters(params_), world_);
  const auto outcome_digests = gather_u64(outcome_digest_, world_);
  const auto finite_flags = gather_u64(params_finite ? 1 : 0, world_);
  // Every rank has finished its last step (the gathers above are collectives): a run that ended
  // well makes its last checkpoint visible.
  if (exit_status_ == 0) guard.commit_pending_checkpoint();
  if (!lead_) return exit_status_;

  const RankAgreement agreement =
      agreement_of(hashes, outcome_digests, finite_flags, params_finite);
  const std::string pictures =
      draw_incident_pictures(o_.incident_dir.empty() ? "" : o_.trace, incidents_);
  write_summary(summary_json(totals, final_loss, agreement));
  print_summary_table(totals, final_loss, agreement, pictures);
  return exit_status_;
}

// The mean loss of the last ten applied steps; NaN when none was applied.
double DemoRun::tail_mean_loss() const {
  const std::size_t tail = std::min<std::size_t>(10, applied_losses_.size());
  double final_loss = std::numeric_limits<double>::quiet_NaN();
  if (tail > 0) {
    double sum = 0.0;
    for (std::size_t i = applied_losses_.size() - tail; i < applied_losses_.size(); ++i) {
      sum += applied_losses_[i];
    }
    final_loss = sum / static_cast<double>(tail);
  }
  return final_loss;
}

void DemoRun::linger() const {
  if (o_.linger_s > 0 && o_.metrics_port >= 0) {
    if (lead_) {
      std::fprintf(stderr, "serving metrics for %" PRId64 " more seconds\n", o_.linger_s);
    }
    std::this_thread::sleep_for(std::chrono::seconds(o_.linger_s));
  }
}

nlohmann::json DemoRun::summary_json(const GuardTotals& totals, double final_loss,
                                     const RankAgreement& agreement) const {
  const GuardStats stats = guard_->stats();  // one read for every figure
  return {
      {"steps", totals.steps},
      {"applied", totals.applied},
      {"skipped", totals.skipped},
      {"rollbacks", totals.rolled_back},
      {"aborted", totals.aborted > 0},
      {"initial_loss", number_or_null(initial_loss_)},
      {"final_loss", number_or_null(final_loss)},
      {"params_finite", agreement.params_finite},
      {"param_hashes", agreement.param_hashes},
      {"outcomes_agree", agreement.outcomes_agree},
      {"loss_scale", stats.loss_scale},
      {"precision", o_.fp16 ? "fp16" : "fp32"},
      {"lr_factor", stats.lr_factor},
      {"policy", o_.policy.empty()
                     ? (o_.max_consecutive_bad_steps >= 0 ? "built-in ladder" : kDefaultPolicyName)
                     : o_.policy},
      {"ranks", world_.size},
      {"seed", o_.seed},
      {"collectives", stats.collective_calls},
      {"step_buffer_bytes", stats.step_buffer_bytes},
      {"batches_consumed", batch_index_},
      {"checkpoints", stats.checkpoints_written},
      {"resumed_from", first_step_ - 1},
      {"incidents", incidents_},
  };
}

void DemoRun::write_summary(const nlohmann::json& summary) const {
  if (o_.summary_json.empty()) return;
  try {
    write_file_atomically(o_.summary_json, dump_json(summary, 2) + "\n");
  } catch (const FileError& e) {
    throw std::runtime_error(std::string("demo: cannot write the summary: ") + e.what());
  }
}

void DemoRun::print_summary_table(const GuardTotals& totals, double final_loss,
                                  const RankAgreement& agreement,
                                  const std::string& pictures) const {
  const GuardStats stats = guard_->stats();  // one read for every figure
  std::ostringstream table;
  table << "\nstepguard demo summary\n";
  char line[256];
  auto row = [&](const char* key, const std::string& value) {
    std::snprintf(line, sizeof line, "  %-16s %s\n", key, value.c_str());
    table << line;
  };
  row("steps", std::to_string(totals.steps) + " of " + std::to_string(o_.steps));
  row("applied", std::to_string(totals.applied));
  row("skipped", std::to_string(totals.skipped));
  if (totals.rolled_back > 0 || totals.snapshots > 0) {
    row("rollbacks", std::to_string(totals.rolled_back) + " (" + std::to_string(totals.snapshots) +
                         " RAM snapshots taken)");
  }
  if (stats.lr_factor != 1.0) {
    std::snprintf(line, sizeof line, "%g", stats.lr_factor);
    row("lr factor", line);
  }
  row("aborted", totals.aborted > 0 ? "yes" : "no");
  std::snprintf(line, sizeof line, "%.4f -> %.4f (%+.1f%%)", initial_loss_, final_loss,
                100.0 * (final_loss / initial_loss_ - 1.0));
  row("loss", line);
  row("params finite", agreement.params_finite ? "yes" : "NO");
  if (o_.fp16) {
    std::snprintf(line, sizeof line, "%g (fp16 emulation)", stats.loss_scale);
    row("loss scale", line);
  }
  if (world_.size == 1) {
    row("param hash", agreement.param_hashes[0].get<std::string>());
  } else {
    row("ranks",
        std::to_string(world_.size) +
            (agreement.hashes_equal ? ", parameters bitwise equal" : ", PARAMETERS DIFFER") +
            (agreement.outcomes_agree ? ", same decision every step" : ", DECISIONS DIFFER"));
  }
  row("collectives",
      std::to_string(stats.collective_calls) +
          (world_.size > 1 ? " (one per step, two more per incident step)" : " (one per step)") +
          ", step buffer " + std::to_string(stats.step_buffer_bytes) + " bytes");
  if (!incidents_.empty()) write_incident_rows(table, incidents_, world_.size);
  if (!pictures.empty()) row("pictures", pictures);
  if (!o_.summary_json.empty()) row("summary json", o_.summary_json);
  if (!o_.trace.empty()) row("trace", o_.trace + (world_.size > 1 ? " (+ .rank<r> per rank)" : ""));
  std::cout << table.str() << std::flush;
}

}  // namespace demo
}  // namespace stepguard
