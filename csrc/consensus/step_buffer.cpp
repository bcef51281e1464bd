#include "csrc/consensus/step_buffer.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <map>
#include <utility>

namespace stepguard {
namespace consensus {

namespace {

constexpr std::uint64_t kChunkMask = 0xFFFF;

std::uint64_t exact(double v) { return static_cast<std::uint64_t>(v); }

// A count summed from weighted parts (1/3 + 1/3 + 1/3 may land a hair off 1): rounded up, with
// the rounding error of the sum forgiven.
std::int64_t whole_count(double v) {
  return v <= 0.0 ? 0 : static_cast<std::int64_t>(std::ceil(v - 1e-6 * std::max(1.0, v)));
}

// Every rank contributed the same value to a chunk exactly when world * sum(c^2) == sum(c)^2
// (Cauchy-Schwarz with equality). The sums are integers below 2^53, so the test is exact.
bool chunks_differ(const double* s, int first, int world) {
  for (int c = 0; c < step_slot::kChunks; ++c) {
    const unsigned __int128 sum = exact(s[first + c]);
    const unsigned __int128 squares = exact(s[first + step_slot::kChunks + c]);
    if (static_cast<unsigned __int128>(world) * squares != sum * sum) return true;
  }
  return false;
}

// The ranks whose value in column `col` differs from the majority; ties go to the lower rank's
// value. Every rank sees the same rows, so every rank names the same outliers.
std::vector<int> outliers(const std::vector<double>& rows, int world, int col) {
  auto at = [&](int r) { return rows[static_cast<std::size_t>(r) * row_slot::kSize + col]; };
  std::map<double, int> votes;
  for (int r = 0; r < world; ++r) ++votes[at(r)];
  double majority = at(0);
  for (int r = 0; r < world; ++r) {
    if (votes[at(r)] > votes[majority]) majority = at(r);
  }
  std::vector<int> out;
  for (int r = 0; r < world; ++r) {
    if (at(r) != majority) out.push_back(r);
  }
  return out;
}

}  // namespace

StepBuffer::StepBuffer(int rank, int world_size, const at::Device& device)
    : rank_(rank),
      world_size_(world_size),
      buffer_(at::zeros({step_slot::kSize}, at::TensorOptions().dtype(at::kDouble).device(device))),
      row_(at::zeros({row_slot::kSize}, buffer_.options())) {
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "stepguard: rank ", rank,
              " is not in a world of ", world_size);
}

void StepBuffer::reset() {
  buffer_.zero_();  // the row is written whole by pack()
}

at::Tensor StepBuffer::inspection_block() const {
  return buffer_.narrow(0, step_slot::kInspection, inspect_slot::kCount);
}

at::Tensor StepBuffer::state_block() const {
  return buffer_.narrow(0, step_slot::kState, inspect_slot::kCount);
}

void StepBuffer::stage_host_values(bool loss_given, std::uint64_t digest,
                                   const LocalEvidence& evidence) {
  const bool on_cuda = buffer_.is_cuda();
  if (!staged_.defined()) {
    // Pinned beside a CUDA buffer: the copies below do not wait for the device.
    staged_ = at::empty({kStagedSlots + row_slot::kSize},
                        at::TensorOptions().dtype(at::kDouble).pinned_memory(on_cuda));
  } else if (staged_copied_) {
    staged_copied_->synchronize();  // the last step's copies have read it (long since, normally)
  }
  double* s = staged_.data_ptr<double>();
  std::fill(s, s + staged_.numel(), 0.0);
  const auto slot = [s](int i) -> double& { return s[i - step_slot::kLossSum]; };
  slot(step_slot::kLossGiven) = loss_given ? 1.0 : 0.0;
  slot(step_slot::kRanksReporting) = 1.0;
  slot(step_slot::kInputRanks) = evidence.inputs_bad ? 1.0 : 0.0;
  slot(step_slot::kProbeRanks) = evidence.probe_bad ? 1.0 : 0.0;
  slot(step_slot::kCheckpointWritten) = evidence.checkpoint_written ? 1.0 : 0.0;
  for (int c = 0; c < step_slot::kChunks; ++c) {
    const double chunk = static_cast<double>((digest >> (16 * c)) & kChunkMask);
    slot(step_slot::kDigest + c) = chunk;
    slot(step_slot::kDigest + step_slot::kChunks + c) = chunk * chunk;
  }
  double* row = s + kStagedSlots;
  row[row_slot::kInputsBad] = slot(step_slot::kInputRanks);
  row[row_slot::kProbeBad] = slot(step_slot::kProbeRanks);
  row[row_slot::kDigest] = static_cast<double>(mask_digest(digest));
  row[row_slot::kLoss] = loss_given ? 0.0 : std::numeric_limits<double>::quiet_NaN();
  buffer_.narrow(0, step_slot::kLossSum, kStagedSlots)
      .copy_(staged_.narrow(0, 0, kStagedSlots), /*non_blocking=*/on_cuda);
  row_.copy_(staged_.narrow(0, kStagedSlots, row_slot::kSize), /*non_blocking=*/on_cuda);
  if (on_cuda) {
    if (!staged_copied_) staged_copied_.emplace(buffer_.device().type());
    const c10::impl::VirtualGuardImpl impl(buffer_.device().type());
    staged_copied_->record(impl.getStream(buffer_.device()));
  }
}

void StepBuffer::pack(const at::Tensor& loss, std::uint64_t digest, const LocalEvidence& evidence,
                      const std::optional<at::Tensor>& fingerprint) {
  // What the host knows, from host memory: every slot between the two inspection blocks and the
  // whole row, the device-made values of those slots written over them below in stream order.
  stage_host_values(loss.defined(), digest, evidence);
  // No loss (step() from the gradients alone): it counts as finite and adds nothing.
  const int block = step_slot::kInspection;
  const at::Tensor grads_bad = (buffer_.select(0, block + inspect_slot::kNanCount) +
                                buffer_.select(0, block + inspect_slot::kInfCount)) > 0;
  at::Tensor faulty = grads_bad;
  if (loss.defined()) {
    const at::Tensor l = loss.detach().reshape({}).to(buffer_.options());
    const at::Tensor nonfinite = at::isfinite(l).logical_not_();
    const at::Tensor finite_l = l.masked_fill(nonfinite, 0.0);
    buffer_.select(0, step_slot::kLossSum).copy_(finite_l);
    buffer_.select(0, step_slot::kLossSquares).copy_(finite_l * finite_l);
    buffer_.select(0, step_slot::kLossInf).copy_(at::isposinf(l));
    buffer_.select(0, step_slot::kLossNonfinite).copy_(nonfinite);
    row_.select(0, row_slot::kLossBad).copy_(nonfinite);
    row_.select(0, row_slot::kLoss).copy_(l);
    faulty = grads_bad.logical_or(nonfinite);
  }
  buffer_.select(0, step_slot::kFaultyRanks).copy_(faulty);
  if (evidence.inputs_counted.defined()) {
    // Device ops: the counts join the buffer without a read of their own.
    const at::Tensor counted = evidence.inputs_counted.to(buffer_.device(), at::kDouble);
    buffer_.select(0, step_slot::kInputRanks)
        .copy_(at::maximum(buffer_.select(0, step_slot::kInputRanks), counted));
  }
  if (evidence.watched_grad_sum.defined()) {
    const at::Tensor watched =
        at::isfinite(evidence.watched_grad_sum).logical_not().to(buffer_.device(), at::kDouble);
    buffer_.select(0, step_slot::kProbeRanks)
        .copy_(at::maximum(buffer_.select(0, step_slot::kProbeRanks), watched));
  }
  const std::pair<int, const at::Tensor*> scales[] = {
      {step_slot::kFrameworkScale, &evidence.framework_scale},
      {step_slot::kFrameworkFloor, &evidence.framework_floor}};
  for (const auto& [slot, value] : scales) {
    if (value->defined()) {
      buffer_.select(0, slot).copy_(value->detach().reshape({}).to(buffer_.options()));
    }
  }
  row_.select(0, row_slot::kGradFault).copy_(grads_bad);
  if (evidence.inputs_counted.defined()) {
    row_.select(0, row_slot::kInputsBad).copy_(buffer_.select(0, step_slot::kInputRanks));
  }
  if (evidence.watched_grad_sum.defined()) {
    row_.select(0, row_slot::kProbeBad).copy_(buffer_.select(0, step_slot::kProbeRanks));
  }
  row_.select(0, row_slot::kStateBad)
      .copy_(buffer_.select(0, step_slot::kState + inspect_slot::kNanCount) +
             buffer_.select(0, step_slot::kState + inspect_slot::kInfCount));
  if (!fingerprint) return;
  const at::Tensor h = fingerprint->to(buffer_.device());
  for (int c = 0; c < step_slot::kChunks; ++c) {
    const at::Tensor shifted = c == 0 ? h : at::div(h, std::int64_t{1} << (16 * c), "floor");
    const at::Tensor chunk = at::remainder(shifted, std::int64_t{65536}).to(at::kDouble);
    buffer_.select(0, step_slot::kFingerprint + c).copy_(chunk);
    buffer_.select(0, step_slot::kFingerprint + step_slot::kChunks + c).copy_(chunk * chunk);
  }
  buffer_.select(0, step_slot::kFingerprintChecked).fill_(1.0);
  const auto masked = at::remainder(h, static_cast<std::int64_t>(step_slot::kDigestMask) + 1);
  // 0 means "not taken": a fingerprint that masks to 0 reads as 1.
  row_.select(0, row_slot::kFingerprint).copy_(at::clamp_min(masked, 1).to(at::kDouble));
}

namespace {
// The slots whose sum makes a step's update impossible (skip_flag()).
constexpr int kSkipSlots[] = {
    step_slot::kInspection + inspect_slot::kNanCount,
    step_slot::kInspection + inspect_slot::kInfCount, step_slot::kLossNonfinite,
    step_slot::kState + inspect_slot::kNanCount, step_slot::kState + inspect_slot::kInfCount};
}  // namespace

at::Tensor StepBuffer::skip_flag() const {
  // Five device ops on views of the buffer, no index tensor: each block's NaN and Inf counts
  // (neighbours) summed into fp32, the non-finite losses added, the sign (counts are >= 0; a
  // weighted count of 1 / copies stays above 0 in fp32).
  static_assert(inspect_slot::kInfCount == inspect_slot::kNanCount + 1, "neighbouring counts");
  at::Tensor flag =
      at::sum(buffer_.narrow(0, step_slot::kInspection + inspect_slot::kNanCount, 2), at::kFloat);
  flag.add_(at::sum(buffer_.narrow(0, step_slot::kState + inspect_slot::kNanCount, 2), at::kFloat));
  flag.add_(buffer_.select(0, step_slot::kLossNonfinite));
  return flag.sign_();
}

at::Tensor StepBuffer::norm_on_device() const {
  const at::Tensor block = buffer_.narrow(0, step_slot::kInspection, inspect_slot::kCount);
  at::Tensor norm = block.select(0, inspect_slot::kSumSquares).sqrt();
  norm.masked_fill_(block.select(0, inspect_slot::kSumSquaresOverflow) > 0.0,
                    std::numeric_limits<double>::infinity());
  norm.masked_fill_(block.narrow(0, inspect_slot::kNanCount, 2).sum() > 0.0,
                    std::numeric_limits<double>::quiet_NaN());
  return norm.to(at::kFloat);
}

bool StepBuffer::skips_on_device(const at::Tensor& host) {
  const double* s = host.data_ptr<double>();
  double sum = 0.0;
  for (int slot : kSkipSlots) sum += s[slot];
  return sum > 0;
}

GlobalStats StepBuffer::unpack(std::int64_t step) const {
  return unpack_host(buffer_.to(at::kCPU), world_size_, step);
}

GlobalStats StepBuffer::unpack_host(const at::Tensor& host, int world_size, std::int64_t step) {
  TORCH_CHECK(host.is_cpu() && host.is_contiguous() && host.scalar_type() == at::kDouble &&
                  host.numel() == step_slot::kSize,
              "stepguard: step ", step, ": a step buffer's host copy must be ", step_slot::kSize,
              " contiguous fp64 values");
  const double* s = host.data_ptr<double>();
  const int world = world_size;
  TORCH_CHECK(static_cast<int>(s[step_slot::kRanksReporting]) == world, "stepguard: step ", step,
              ": ", s[step_slot::kRanksReporting], " of ", world,
              " ranks reported statistics; the consensus buffer is inconsistent");
  const double* inspected = s + step_slot::kInspection;
  GlobalStats g;
  g.world_size = world;
  // Each rank weighted its gradients by 1 / copies (inspect_counted_once): the sums count every
  // element once. Counts are fractions where the copies of a gradient disagree: rounded up, so
  // one bad copy of a NaN counts.
  g.nan_count = whole_count(inspected[inspect_slot::kNanCount]);
  g.inf_count = whole_count(inspected[inspect_slot::kInfCount]);
  g.sum_squares_overflow = inspected[inspect_slot::kSumSquaresOverflow] > 0.0;
  g.sum_squares = g.sum_squares_overflow ? std::numeric_limits<double>::infinity()
                                         : inspected[inspect_slot::kSumSquares];
  g.grad_norm = std::sqrt(g.sum_squares);
  g.loss_nonfinite_ranks = static_cast<std::int64_t>(s[step_slot::kLossNonfinite]);
  g.loss_given_ranks = static_cast<std::int64_t>(s[step_slot::kLossGiven]);
  const std::int64_t finite_ranks = g.loss_given_ranks - g.loss_nonfinite_ranks;
  const auto inf_ranks = static_cast<std::int64_t>(s[step_slot::kLossInf]);
  if (finite_ranks > 0) {
    const auto n = static_cast<double>(finite_ranks);
    g.loss = s[step_slot::kLossSum] / n;
    // Samuelson: no value lies more than sd * sqrt(n - 1) above the mean of n values.
    const double variance = std::max(0.0, s[step_slot::kLossSquares] / n - g.loss * g.loss);
    g.loss_max_bound = g.loss + std::sqrt(variance * (n - 1.0));
  } else {
    // Every given loss is bad: +Inf when each of them is +Inf (an overflow, log(0)), else NaN.
    g.loss = inf_ranks > 0 && inf_ranks == g.loss_nonfinite_ranks
                 ? std::numeric_limits<double>::infinity()
                 : std::numeric_limits<double>::quiet_NaN();
    g.loss_max_bound = std::numeric_limits<double>::quiet_NaN();
  }
  g.faulty_rank_count = static_cast<std::int64_t>(s[step_slot::kFaultyRanks]);
  g.input_bad_ranks = static_cast<std::int64_t>(s[step_slot::kInputRanks]);
  g.probe_bad_ranks = static_cast<std::int64_t>(s[step_slot::kProbeRanks]);
  g.checkpoint_written_ranks = static_cast<std::int64_t>(s[step_slot::kCheckpointWritten]);
  g.framework_loss_scale = s[step_slot::kFrameworkScale] / world;  // every rank's scaler's mean
  g.framework_min_scale = s[step_slot::kFrameworkFloor] / world;
  g.state_differs = chunks_differ(s, step_slot::kDigest, world);
  g.state_bad_count = whole_count(s[step_slot::kState + inspect_slot::kNanCount]) +
                      whole_count(s[step_slot::kState + inspect_slot::kInfCount]);
  const double checked = s[step_slot::kFingerprintChecked];
  g.replica_checked = checked == world;
  g.replica_differs =
      checked > 0 && (checked != world || chunks_differ(s, step_slot::kFingerprint, world));
  return g;
}

bool needs_rank_detail(const GlobalStats& g) noexcept {
  return g.faulty_rank_count > 0 || g.loss_nonfinite_ranks > 0 || g.input_bad_ranks > 0 ||
         g.probe_bad_ranks > 0 || g.state_differs || g.replica_differs || g.state_bad_count > 0;
}

std::vector<double> gather_rank_rows(Consensus& consensus, const at::Tensor& row,
                                     std::int64_t step) {
  const int world = consensus.world_size();
  const std::int64_t width = row.numel();
  if (world == 1) {
    const at::Tensor host = row.to(at::kCPU, at::kDouble).contiguous();
    return std::vector<double>(host.data_ptr<double>(), host.data_ptr<double>() + width);
  }
  at::Tensor rows = at::zeros({world * width}, row.options().dtype(at::kDouble));
  rows.narrow(0, consensus.rank() * width, width).copy_(row);
  consensus.all_reduce_sum(rows, step);
  const at::Tensor host = rows.to(at::kCPU);
  return std::vector<double>(host.data_ptr<double>(), host.data_ptr<double>() + world * width);
}

void fill_rank_detail(const std::vector<double>& rows, int world, GlobalStats* g) {
  TORCH_CHECK(rows.size() == static_cast<std::size_t>(world) * row_slot::kSize,
              "stepguard: ", rows.size(), " rank-row slots for ", world, " ranks");
  auto at = [&](int r, int col) {
    return rows[static_cast<std::size_t>(r) * row_slot::kSize + col];
  };
  g->ranks_named = true;
  g->faulty_ranks.clear();
  g->origin_ranks.clear();
  g->rank_losses.clear();
  g->state_bad_ranks.clear();
  std::vector<int> probed;  // a probe's or the gradient watch's ranks
  for (int r = 0; r < world; ++r) {
    g->rank_losses.push_back(at(r, row_slot::kLoss));
    if (at(r, row_slot::kGradFault) > 0 || at(r, row_slot::kLossBad) > 0) {
      g->faulty_ranks.push_back(r);
    }
    if (at(r, row_slot::kLossBad) > 0 || at(r, row_slot::kInputsBad) > 0) {
      g->origin_ranks.push_back(r);
    }
    if (at(r, row_slot::kProbeBad) > 0) probed.push_back(r);
    if (at(r, row_slot::kStateBad) > 0) g->state_bad_ranks.push_back(r);
  }
  // A rank's own loss and inputs first: a NaN made on one tensor-, pipeline- or expert-parallel
  // rank reaches its peers' activations and gradients through the model's collectives before
  // any probe or gradient hook there sees it, never their losses.
  if (g->origin_ranks.empty()) g->origin_ranks = probed;
  // Shards reduced before any hook saw them: a faulty shard is where a NaN landed, not where it
  // was made (a rank's state check below is its own evidence).
  if (g->origin_ranks.empty() && !g->shards_unwatched) g->origin_ranks = g->faulty_ranks;
  g->desynced_ranks =
      g->state_differs ? outliers(rows, world, row_slot::kDigest) : std::vector<int>();
  g->diverged_replicas =
      g->replica_differs ? outliers(rows, world, row_slot::kFingerprint) : std::vector<int>();
  // A finite step where one replica drifted: the fault is that replica's; one whose optimizer
  // state went bad, that state's.
  if (g->origin_ranks.empty()) g->origin_ranks = g->diverged_replicas;
  if (g->origin_ranks.empty()) g->origin_ranks = g->state_bad_ranks;
  g->origin_unknown = g->origin_ranks.empty() && !g->faulty_ranks.empty();
}

void name_spike_ranks(double level, GlobalStats* g) {
  double largest = 0.0;
  for (double loss : g->rank_losses) {
    if (std::isfinite(loss)) largest = std::max(largest, loss - level);
  }
  if (!(largest > 0.0)) return;
  g->origin_ranks.clear();
  for (std::size_t r = 0; r < g->rank_losses.size(); ++r) {
    const double rise = g->rank_losses[r] - level;
    if (std::isfinite(rise) && rise >= 0.5 * largest)
      g->origin_ranks.push_back(static_cast<int>(r));
  }
}

at::Tensor parameter_fingerprint(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> sums;
  at::Device device = at::kCPU;
  for (const at::Tensor& p : params) {
    if (!p.defined() || !at::isFloatingType(p.scalar_type())) continue;
    device = p.device();
    at::ScalarType bits;
    switch (p.element_size()) {
      case 2:
        bits = at::kShort;
        break;
      case 4:
        bits = at::kInt;
        break;
      case 8:
        bits = at::kLong;
        break;
      default:
        continue;
    }
    sums.push_back(at::sum(p.detach().view(bits), at::kLong));
  }
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  if (sums.empty()) return at::zeros({}, opts);
  // Odd, position-dependent multipliers: the same bits in another tensor give another value.
  const at::Tensor position = at::arange(static_cast<std::int64_t>(sums.size()), opts);
  const at::Tensor weight = (position * 2 + 1) * std::int64_t{0x5851F42D4C957F2D};
  return (at::stack(sums) * weight).sum();
}

at::Tensor tensor_fingerprints(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> sums;
  at::Device device = at::kCPU;
  for (const at::Tensor& p : params) {
    if (p.defined()) device = p.device();
  }
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  for (const at::Tensor& p : params) {
    const at::Tensor one = p.defined() ? parameter_fingerprint({p}) : at::zeros({}, opts);
    sums.push_back(one.to(device));
  }
  if (sums.empty()) return at::zeros({0}, opts.dtype(at::kDouble));
  const auto mask = static_cast<std::int64_t>(step_slot::kDigestMask) + 1;
  return at::remainder(at::stack(sums), mask).to(at::kDouble);
}

std::vector<std::size_t> diverged_tensors(const std::vector<double>& rows, int world,
                                          std::size_t count, const std::vector<int>& diverged) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < count; ++i) {
    std::map<double, int> votes;
    for (int r = 0; r < world; ++r) {
      if (std::find(diverged.begin(), diverged.end(), r) == diverged.end()) {
        ++votes[rows[static_cast<std::size_t>(r) * count + i]];
      }
    }
    if (votes.empty()) continue;
    const auto majority = std::max_element(votes.begin(), votes.end(), [](auto& a, auto& b) {
                            return a.second < b.second;
                          })->first;
    for (int r : diverged) {
      if (rows[static_cast<std::size_t>(r) * count + i] != majority) {
        out.push_back(i);
        break;
      }
    }
  }
  return out;
}

}  // namespace consensus
}  // namespace stepguard
