// StepEngine's exchanges: the step's inspection and its one collective, and on an incident step
// what the ranks tell each other beyond it (each rank's blamed tensors, the replicas' tensor
// fingerprints, the ranks' losses on a spike) and the cause the job agrees on from the origin
// ranks' findings; and the layout the ranks agreed at construction, kept as it was.
#include <algorithm>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include "csrc/policy/trend.h"
#include "plugin/src/step_internal.h"

namespace stepguard {

// 1 inspect: the fused pass writes the step buffer on the gradients' device, with this rank's
// evidence beside it. Nothing is read back.
consensus::StepBuffer& StepEngine::inspect_and_pack(const at::Tensor& loss, std::int64_t step,
                                                    Agreed* out) {
  Agreed& a = *out;
  inspect::InspectOptions inspect_options;
  if (controller_.loss_scaling()) {
    // The fused pass unscales in place: the optimizer then sees true gradients.
    inspect_options.inv_scale = controller_.inv_loss_scale();
    inspect_options.unscale_in_place = true;
  } else if (framework_scale_ && framework_scale_->gradients_scaled) {
    // The framework unscales in its own step: the guard reads the gradients unscaled, in place
    // nothing changes.
    inspect_options.inv_scale = 1.0 / framework_scale_->scale;
  }
  if (!step_device_) {
    // No gradient and no loss: the buffer goes where the parameters are.
    const auto& params = port_.parameters();
    step_device_ = params.empty() ? at::Device(at::kCPU) : params.front().device();
  }
  // One buffer for the guard's life, zeroed each step (made again only if the device changes).
  if (step_buffer_ && step_buffer_->device() == *step_device_) {
    step_buffer_->reset();
  } else {
    step_buffer_.emplace(consensus_->rank(), consensus_->world_size(), *step_device_);
  }
  consensus::StepBuffer& buffer = *step_buffer_;
  const auto t_inspect = EngineClock::now();
  {
    RECORD_USER_SCOPE("stepguard::inspect");
    // Validation inside inspection throws before anything changes.
    inspect::inspect_counted_once(port_.gradients(), layout_.copies, inspect_options,
                                  buffer.inspection_block(), &a.local, &a.blame);
    state_check_.run_if_due(step, policy::state_check_every(controller_.config().detectors.trends),
                            port_, buffer.state_block());
  }
  a.inspect_seconds = seconds_since(t_inspect);
  consensus::LocalEvidence local_evidence;
  if (input_check_) {
    local_evidence.inputs_bad = input_check_->known_bad();
    local_evidence.inputs_counted = input_check_->any_counted();
  }
  local_evidence.probe_bad = probes_.any_nonfinite();
  local_evidence.watched_grad_sum = watched_grad_sum_;
  local_evidence.checkpoint_written = recovery_.checkpoint_written();
  if (framework_scale_) {  // a scaler's device tensors: no read of their own
    local_evidence.framework_scale = framework_scale_->scale_tensor;
    local_evidence.framework_floor = framework_scale_->min_scale_tensor;
  }
  std::optional<at::Tensor> fingerprint;
  if (replica_check_due(step)) fingerprint = consensus::parameter_fingerprint(port_.parameters());
  buffer.pack(loss, controller_.digest(step_), local_evidence, fingerprint);
  step_ = step;
  ++data_position_;  // this step's batch
  return buffer;
}

// 1 inspect, 2 agree: the one collective sums the buffer, and its one read to the host yields
// the agreed statistics.
StepEngine::Agreed StepEngine::inspect_and_agree(const at::Tensor& loss, std::int64_t step) {
  Agreed a;
  consensus::StepBuffer& buffer = inspect_and_pack(loss, step, &a);
  const auto t_agree = EngineClock::now();
  agree_or_abort([&] {
    RECORD_USER_SCOPE("stepguard::agree");
    consensus_->all_reduce_sum(buffer.tensor(), step);
    agree_counts(buffer.tensor().to(at::kCPU), buffer.rank_row(), step, state_check_.ran(), &a);
  });
  a.agree_seconds = seconds_since(t_agree);
  return a;
}

void StepEngine::agree_counts(const at::Tensor& host, const at::Tensor& rank_row, std::int64_t step,
                              bool state_checked, Agreed* a) {
  a->global = consensus::StepBuffer::unpack_host(host, consensus_->world_size(), step);
  a->global.state_checked = state_checked;
  a->global.shards_unwatched = reduced_into_shards_ && !watched_grad_sum_.defined();
  a->rank_row = rank_row;
  // The rare step where a count says a rank saw something or differs: one more collective
  // names the ranks (the steady-state buffer is the same size at any world size).
  if (consensus::needs_rank_detail(a->global)) {
    consensus::fill_rank_detail(consensus::gather_rank_rows(*consensus_, rank_row, step),
                                consensus_->world_size(), &a->global);
  }
  if (a->global.replica_checked && a->global.diverged_replicas.empty()) {
    recovery_.replicas_agreed_before(step);  // snapshots taken before hold agreeing replicas
  }
}

void StepEngine::agree_or_abort(const std::function<void()>& exchange) {
  try {
    exchange();
  } catch (const std::exception& e) {
    // The ranks can no longer agree: nothing may be applied from here on. A ConsensusError
    // (naming the step and the missing ranks) goes to the caller as it is.
    abort_with(e.what());
    throw;
  }
}

// Every rank's blamed gradients, by name, to every rank (names, not indices: the ranks' lists
// differ under pipeline parallelism and sharding). Two collectives, on a non-finite step only:
// the lengths, then the names, one byte per slot, -1 between names.
std::vector<std::string> StepEngine::blame_across_ranks(const std::vector<std::string>& mine,
                                                        std::int64_t step) {
  constexpr std::size_t kMaxBytes = 16384;  // per rank: max_blamed_tensors names of any length
  std::vector<double> packed;
  for (const std::string& name : mine) {
    if (packed.size() + name.size() + 1 > kMaxBytes) break;
    for (unsigned char c : name) packed.push_back(static_cast<double>(c));
    packed.push_back(-1.0);
  }
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor length = at::full({1}, static_cast<double>(packed.size()), opts);
  const std::vector<double> lengths =
      consensus::gather_rank_rows(*consensus_, length.to(*step_device_), step);
  const auto width = static_cast<std::int64_t>(*std::max_element(lengths.begin(), lengths.end()));
  std::vector<std::string> out;
  if (width == 0) return out;
  at::Tensor row = at::zeros({width}, opts);
  if (!packed.empty()) {
    row.narrow(0, 0, static_cast<std::int64_t>(packed.size())).copy_(at::tensor(packed, opts));
  }
  const std::vector<double> rows =
      consensus::gather_rank_rows(*consensus_, row.to(*step_device_), step);
  const int world = consensus_->world_size();
  for (int r = 0; r < world; ++r) {
    std::string name;
    const auto n = static_cast<std::size_t>(lengths[static_cast<std::size_t>(r)]);
    for (std::size_t j = 0; j < n; ++j) {
      const double c = rows[static_cast<std::size_t>(r) * static_cast<std::size_t>(width) + j];
      if (c >= 0.0) {
        name.push_back(static_cast<char>(static_cast<unsigned char>(c)));
        continue;
      }
      if (std::find(out.begin(), out.end(), name) == out.end() &&
          static_cast<std::int64_t>(out.size()) < options_.max_blamed_tensors()) {
        out.push_back(name);
      }
      name.clear();
    }
  }
  return out;
}

// Every rank's `row` (gather_rank_rows) in a decision's collective: a rank that cannot join it
// may not train on alone, as for the step's own collective.
std::vector<double> StepEngine::gather_or_abort(const at::Tensor& row) {
  try {
    return consensus::gather_rank_rows(*consensus_, row, step_);
  } catch (const std::exception& e) {
    abort_with(e.what());
    throw;
  }
}

// On the step a replica check found a diverged replica: one more collective (each tensor's
// fingerprint, from every rank) names the tensors that differ, the same list on every rank.
std::vector<std::string> StepEngine::diverged_tensor_names(const GlobalStats& g) {
  const auto& params = port_.parameters();
  const at::Tensor mine = consensus::tensor_fingerprints(params);
  const std::vector<double> rows = gather_or_abort(mine.to(*step_device_));
  std::vector<std::string> out;
  const auto& names = port_.parameter_names();
  for (std::size_t i : consensus::diverged_tensors(rows, consensus_->world_size(), params.size(),
                                                   g.diverged_replicas)) {
    if (static_cast<std::int64_t>(out.size()) >= options_.max_blamed_tensors()) break;
    out.push_back(names[i]);
  }
  return out;
}

void StepEngine::name_spike_ranks(Agreed* agreed, const StepDecision& decided) {
  const Signals& s = decided.signals;
  if (!(s.has(Signal::kLossSpike) || s.has(Signal::kLossRatio) || s.has(Signal::kRankLossShift)) ||
      consensus_->world_size() == 1) {
    return;
  }
  GlobalStats& g = agreed->global;
  if (!g.ranks_named) {
    consensus::fill_rank_detail(gather_or_abort(agreed->rank_row), consensus_->world_size(), &g);
  }
  if (g.origin_ranks.empty()) consensus::name_spike_ranks(s.loss_level, &g);
}

namespace {

// Gradients reduced into shards before any hook: which rank made the NaN is not known, and the
// report says so instead of naming the shards' ranks as the origin.
void say_origin_unknown(const GlobalStats& g, forensics::Diagnosis* d) {
  d->evidence.insert(
      d->evidence.begin(),
      "which rank made the NaN/Inf is not known: the gradients reached the guard already "
      "reduce-scattered into shards, with no hook before the reduction (FSDP2), so a shard holds "
      "what every rank sent it; the shards holding NaN/Inf are on rank" +
          std::string(g.faulty_ranks.size() > 1 ? "s " : " ") + rank_list(g.faulty_ranks));
  d->fixes.push_back(
      "to have the rank named next time: a non-finite loss names it, and so do check_inputs() "
      "and probe() on the layers before the loss (each rank's own, before the reduction)");
}

// The debugging order in which causes are checked: the job's cause is the first any origin rank
// found (a rank that reproduced bad data outranks another's clean replay).
int debugging_rank(Cause c) {
  constexpr Cause kOrder[] = {Cause::kData,
                              Cause::kOptimizerState,
                              Cause::kForward,
                              Cause::kPrecisionOverflow,
                              Cause::kDivergence,
                              Cause::kBackward,
                              Cause::kHardwareSuspect,
                              Cause::kUnknown};
  for (int i = 0; i < static_cast<int>(std::size(kOrder)); ++i) {
    if (kOrder[i] == c) return i;
  }
  return static_cast<int>(std::size(kOrder));
}

}  // namespace

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

// On an incident step the ranks exchange what the origin ranks found (one small collective,
// incident steps only): every rank's report then carries each origin rank's cause and the one
// cause agreed for the job.
void StepEngine::agree_causes(std::int64_t step, const GlobalStats& g, Findings* f) {
  const int world = consensus_->world_size();
  std::vector<double> rows;
  if (world == 1) {
    rows = {1.0, static_cast<double>(f->diagnosis.cause) + 1.0};
  } else {
    const at::Tensor row =
        at::tensor({f->origin ? 1.0 : 0.0,
                    f->origin ? static_cast<double>(f->diagnosis.cause) + 1.0 : 0.0},
                   at::TensorOptions().dtype(at::kDouble))
            .to(*step_device_);
    rows = consensus::gather_rank_rows(*consensus_, row, step);
  }
  std::vector<RankCause> causes;
  for (int r = 0; r < world; ++r) {
    const double code = rows[static_cast<std::size_t>(r) * 2 + 1];
    if (rows[static_cast<std::size_t>(r) * 2] > 0 && code >= 1.0 &&
        code <= static_cast<double>(Cause::kUnknown) + 1.0) {
      causes.push_back({r, static_cast<Cause>(static_cast<int>(code) - 1)});
    }
  }
  // Without evidence from before the average, every rank with bad gradients replayed its own
  // batch: the ranks whose replay came out clean while another's reproduced were not the origin.
  const bool pre_average_evidence =
      g.loss_nonfinite_ranks > 0 || g.input_bad_ranks > 0 || g.probe_bad_ranks > 0;
  const bool someone_reproduced = std::any_of(causes.begin(), causes.end(), [](const RankCause& c) {
    return c.cause != Cause::kHardwareSuspect && c.cause != Cause::kUnknown;
  });
  // A replica the replica check found drifted keeps its finding: that is evidence of its own.
  const auto& drifted = g.diverged_replicas;
  if (!pre_average_evidence && someone_reproduced && causes.size() > 1) {
    causes.erase(std::remove_if(causes.begin(), causes.end(),
                                [&](const RankCause& c) {
                                  return c.cause == Cause::kHardwareSuspect &&
                                         std::find(drifted.begin(), drifted.end(), c.rank) ==
                                             drifted.end();
                                }),
                 causes.end());
    if (g.ranks_named && !g.origin_unknown) {  // (a cause is not a rank's own evidence)
      f->origin_ranks.clear();
      for (const RankCause& c : causes) f->origin_ranks.push_back(c.rank);
    }
  }
  f->agreed_cause = Cause::kUnknown;
  for (const RankCause& c : causes) {
    if (debugging_rank(c.cause) < debugging_rank(f->agreed_cause)) f->agreed_cause = c.cause;
  }
  f->rank_causes = std::move(causes);
  const bool counted =
      std::any_of(f->rank_causes.begin(), f->rank_causes.end(),
                  [&](const RankCause& c) { return c.rank == consensus_->rank(); });
  f->origin = counted;
  if (g.origin_unknown) say_origin_unknown(g, &f->diagnosis);
  if (counted || world == 1) return;
  point_to_origin(g, f);
}

// This rank was not where the fault came from: its report says where it did.
void StepEngine::point_to_origin(const GlobalStats& g, Findings* f) {
  forensics::Diagnosis& d = f->diagnosis;
  d.cause = f->agreed_cause;
  // What this rank looked at, and only that: its inputs only when check_inputs() ran.
  const bool own_grads_bad = std::find(g.faulty_ranks.begin(), g.faulty_ranks.end(),
                                       consensus_->rank()) != g.faulty_ranks.end();
  const std::string grads = g.nonfinite_count() == 0 ? ""
                            : own_grads_bad
                                ? "; its gradients held NaN/Inf only through the gradient " +
                                      std::string(job_replicated_ ? "average" : "reduction")
                                : "; its own gradients were finite (the fault stayed on that rank)";
  d.evidence = {
      "the fault came from rank" + std::string(f->origin_ranks.size() > 1 ? "s " : " ") +
          rank_list(f->origin_ranks) + "; on this rank the loss" +
          (f->evidence.inputs_checked ? " and the inputs check_inputs() read were" : " was") +
          " clean" + grads,
      "agreed cause: " + std::string(to_string(f->agreed_cause)) +
          " (the first in the debugging order among the origin ranks' causes)"};
  if (!f->evidence.state_findings.empty()) {  // what the state check found (agreed, exchanged)
    d.evidence.insert(d.evidence.begin() + 1, f->evidence.state_findings.begin(),
                      f->evidence.state_findings.end());
  }
  const std::string origin =
      f->origin_ranks.empty() ? std::string("?") : std::to_string(f->origin_ranks[0]);
  d.fixes = {options_.incident_dir().empty()
                 ? "read rank " + origin +
                       "'s incident first (its log line and its report's "
                       "incident; set incident_dir to have it written to a file)"
                 : "read the incident report of rank " + origin + " first"};
}

void StepEngine::refresh_layout() {
  const bool was = layout_.all_replicas;
  layout_ = resolve_layout(port_.layout(), port_.parameters(), port_.parameter_names(),
                           options_.sharded_gradients(), consensus_->world_size());
  // What the ranks agreed at construction holds for the guard's life (fingerprints, blame).
  TORCH_CHECK(step_ == 0 || layout_.all_replicas == was,
              "stepguard: the port's layout changed from ",
              was ? "replicas only" : "a parallel one", " to ",
              layout_.all_replicas ? "replicas only" : "a parallel one",
              " after the guard was built; build a new guard for a new layout");
}

}  // namespace stepguard
