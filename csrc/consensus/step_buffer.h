/*
 * The per-step buffer: the one fp64 tensor that ONE sum all-reduce carries across ranks each step,
 * and the per-rank rows gathered on the rare step that needs them. This file is their only owner:
 * it names the slots, packs what a rank contributes, and unpacks the sums into GlobalStats.
 *
 * The step buffer has a FIXED size, whatever the number of ranks (kSize slots, 8 bytes each):
 *   inspection's block (stepguard::inspect_slot, written through inspection_block()),
 *   the loss sum and the sum of its squares (the spread: an upper bound of the largest rank
 *   loss), the counts of ranks with a non-finite loss, with an Inf loss, reporting, with non-finite
 *   gradients, with bad inputs (check_inputs) and with a non-finite probe,
 *   the count of ranks whose background checkpoint write has finished, the optimizer state
 *   check's block (NaN, Inf and negative second-moment elements of the state),
 *   the guard-state digest and the parameter fingerprint, each split into four 16-bit chunks
 *   carried as a sum and a sum of squares: the ranks agree exactly when
 *   world * sum(c^2) == sum(c)^2 for every chunk (exact: every term is an integer below 2^53).
 * Which ranks are faulty and which replica diverged are found only when a count or a chunk says
 * something is off: then rank_row() is gathered from every rank (gather_rank_rows(), one more
 * collective, world_size x kRowSize slots) and fill_rank_detail() names them.
 *
 * Not here: running the collective (consensus.h) or what the numbers mean (policy). Not
 * thread-safe: one per step, on the training thread.
 */
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "csrc/consensus/consensus.h"
#include "csrc/core/stats.h"

namespace stepguard {
namespace consensus {

namespace step_slot {
constexpr int kInspection = 0;                                ///< inspection's block starts here
constexpr int kLossSum = kInspection + inspect_slot::kCount;  ///< sum of the finite local losses
constexpr int kLossNonfinite = kLossSum + 1;                  ///< ranks whose loss is NaN/Inf
constexpr int kLossGiven = kLossNonfinite + 1;   ///< ranks that gave a loss (step() may have none)
constexpr int kRanksReporting = kLossGiven + 1;  ///< each rank adds 1
constexpr int kFaultyRanks = kRanksReporting + 1;  ///< ranks with a non-finite gradient or loss
constexpr int kInputRanks = kFaultyRanks + 1;      ///< ranks whose check_inputs() failed
/// ranks with a non-finite probe, or a NaN/Inf gradient before the framework's reduction
constexpr int kProbeRanks = kInputRanks + 1;
constexpr int kChunks = 4;                           ///< 16-bit chunks of a 64-bit digest
constexpr int kDigest = kProbeRanks + 1;             ///< guard state: kChunks sums, kChunks squares
constexpr int kFingerprint = kDigest + 2 * kChunks;  ///< parameters: the same, 0 when not checked
constexpr int kFingerprintChecked = kFingerprint + 2 * kChunks;  ///< ranks that fingerprinted
/// Ranks with no disk checkpoint write still running in the background.
constexpr int kCheckpointWritten = kFingerprintChecked + 1;
constexpr int kLossSquares = kCheckpointWritten + 1;  ///< sum of the finite losses' squares
constexpr int kLossInf = kLossSquares + 1;            ///< ranks whose loss is +Inf
/// The framework's loss scale and its floor as each rank's scaler holds them on the device
/// (GradScaler, Megatron's): summed, the mean arrives with the one read (0: none given).
constexpr int kFrameworkScale = kLossInf + 1;
constexpr int kFrameworkFloor = kFrameworkScale + 1;
/// The optimizer state check's inspection block (inspect_slot order; a negative second moment
/// counts with the NaNs): zero on the steps it does not run.
constexpr int kState = kFrameworkFloor + 1;
constexpr int kSize = kState + inspect_slot::kCount;  ///< slots, at any world size
/// Digests are masked to the integers fp64 holds exactly in a rank row.
constexpr std::uint64_t kDigestMask = (std::uint64_t{1} << 52) - 1;
}  // namespace step_slot

/// One rank's row of the incident-step gather.
namespace row_slot {
constexpr int kGradFault = 0;    ///< this rank's gradients held NaN/Inf
constexpr int kLossBad = 1;      ///< this rank's loss was NaN/Inf (before any gradient average)
constexpr int kInputsBad = 2;    ///< this rank's check_inputs() failed
constexpr int kProbeBad = 3;     ///< a probe, or the gradient watch, on this rank saw NaN/Inf
constexpr int kDigest = 4;       ///< guard-state digest, masked to 52 bits
constexpr int kFingerprint = 5;  ///< parameter fingerprint, masked to 52 bits (0 = not taken)
constexpr int kLoss = 6;         ///< this rank's loss as it is (NaN when step() had none)
constexpr int kStateBad = 7;     ///< this rank's optimizer state held bad elements
constexpr int kSize = 8;
}  // namespace row_slot

/// What this rank knows on the host before the collective: rank-local evidence that exists
/// before the gradients are averaged.
struct LocalEvidence {
  bool inputs_bad = false;    ///< known on the host (e.g. sequences of length 0)
  at::Tensor inputs_counted;  ///< 0-d bool on the device: check_inputs() counted bad values
  bool probe_bad = false;
  /// 0-d on the device (undefined: not watched): the sum of this rank's own gradients before
  /// the framework reduced them, NaN/Inf when one held NaN/Inf. Counted with the probes:
  /// evidence from before the reduction, which names this rank as an origin.
  at::Tensor watched_grad_sum;
  /// No checkpoint write of this rank is still running (checkpoints become visible only once
  /// every rank's has finished).
  bool checkpoint_written = true;
  /// One-element tensors on any device (undefined: none): the framework's loss scale and its
  /// floor where the framework's scaler keeps them on the device, so that they reach the host
  /// with the step's one read instead of a read of their own before it.
  at::Tensor framework_scale;
  at::Tensor framework_floor;
};

class StepBuffer {
 public:
  /// A zeroed buffer for `rank` of `world_size`, on `device` (the gradients').
  StepBuffer(int rank, int world_size, const at::Device& device);
  /// Zeroes the buffer for the next step (a buffer kept across steps: no allocation per step;
  /// pack() writes the row whole). In stream order on a device: a copy of the last step's sum
  /// that is still in flight reads it before the zeroing does.
  void reset();
  at::Device device() const { return buffer_.device(); }

  /// The block inspection writes (inspect_slot order), a view into the buffer.
  at::Tensor inspection_block() const;
  /// The block the optimizer state check writes (inspect_slot order), a view into the buffer.
  at::Tensor state_block() const;
  /// Adds this rank's loss, fault flag, evidence, state digest and (on a replica-check step) the
  /// parameter fingerprint (an int64 scalar on the device, parameter_fingerprint()). What the
  /// host knows (the digest, the host's flags) goes in from host memory in one copy for the
  /// buffer and one for the row (pinned, not waited for, beside a CUDA buffer); the rest are
  /// device ops. Nothing is read back before the collective. Call after inspection wrote its
  /// block.
  void pack(const at::Tensor& loss, std::uint64_t digest, const LocalEvidence& evidence,
            const std::optional<at::Tensor>& fingerprint = std::nullopt);
  /// The whole buffer, for the collective.
  at::Tensor& tensor() noexcept { return buffer_; }
  /// After the sum: the one read to the host, into the agreed statistics (counts; the per-rank
  /// lists stay empty until fill_rank_detail()). Throws c10::Error naming `step` when not every
  /// rank reported. The inspection block holds each rank's gradients weighted by 1 / copies
  /// (inspect_counted_once()), so its sums count every gradient element of the job once.
  GlobalStats unpack(std::int64_t step) const;
  /// unpack() of a host copy of a summed buffer of `world_size` ranks (the deferred verdict's,
  /// copied without a wait).
  static GlobalStats unpack_host(const at::Tensor& host, int world_size, std::int64_t step);
  /// After the sum, on the buffer's device without a read: 1.0f when the step's update must not
  /// run whatever the policy says (a NaN/Inf gradient or loss on any rank, a bad optimizer
  /// state), else 0.0f; the `found_inf` of torch's fused optimizers. skips_on_device() answers
  /// the same from a host copy.
  at::Tensor skip_flag() const;
  static bool skips_on_device(const at::Tensor& host);
  /// After the sum, on the buffer's device without a read: the agreed gradient norm as a 0-d
  /// fp32 tensor (the fp64 sum of squares' root, rounded once), +Inf when the sum of squares
  /// overflowed, NaN when a gradient on any rank held NaN/Inf: the norm a framework's clip and
  /// its log take from the deferred verdict, as the host's unpack() would give it.
  at::Tensor norm_on_device() const;
  /// This rank's row for gather_rank_rows() (row_slot order), on the buffer's device; valid
  /// after pack().
  const at::Tensor& rank_row() const noexcept { return row_; }
  /// Bytes the step's collective carries: the same at every world size.
  static constexpr std::int64_t bytes() noexcept { return step_slot::kSize * sizeof(double); }

 private:
  /// The slots from kLossSum up to the state block: what stage_host_values() writes.
  static constexpr int kStagedSlots = step_slot::kState - step_slot::kLossSum;
  void stage_host_values(bool loss_given, std::uint64_t digest, const LocalEvidence& evidence);

  int rank_;
  int world_size_;
  at::Tensor buffer_;
  at::Tensor row_;
  at::Tensor staged_;  ///< host: the staged slots, then the row
  /// Beside a CUDA buffer: the staged copies' completion, waited for before the host rewrites
  /// them (the next step's read has normally waited for it long before).
  std::optional<c10::Event> staged_copied_;
};

/// Whether the agreed counts say a rank differs or saw something: then the per-rank rows are
/// needed to name the ranks (the same answer on every rank).
bool needs_rank_detail(const GlobalStats& g) noexcept;

/// Every rank's `row` (same length everywhere, on `device`), in rank order, flattened: one sum
/// all-reduce of world_size x row.numel() slots. `step` names the exchange in errors.
std::vector<double> gather_rank_rows(Consensus& consensus, const at::Tensor& row,
                                     std::int64_t step);

/// Names the faulty, desynced, diverged and origin ranks and reads the rank losses from the
/// gathered rows (row_slot order). Pure; the same rows give the same lists on every rank. With
/// g->shards_unwatched, faulty ranks are not taken for the origin: origin_unknown instead.
void fill_rank_detail(const std::vector<double>& rows, int world_size, GlobalStats* g);

/// On a loss-spike step, after fill_rank_detail(): the ranks whose loss rose from `level` by at
/// least half the largest rank's rise become the origin ranks (one rank's bad batch names that
/// rank; a spike on every rank names them all). Nothing when no rank's loss rose.
void name_spike_ranks(double level, GlobalStats* g);

/// Masks a 64-bit state digest to what a rank row carries exactly.
constexpr std::uint64_t mask_digest(std::uint64_t digest) noexcept {
  return digest & step_slot::kDigestMask;
}

/// A cheap, exact fingerprint of `params` on their device: the integer sum of each tensor's bit
/// patterns, mixed with its position (int64 arithmetic wraps and is associative, so every rank
/// holding the same bits gets the same value, in any reduction order). One read of the
/// parameters; no host read. Undefined and non-floating tensors are left out.
at::Tensor parameter_fingerprint(const std::vector<at::Tensor>& params);

/// Each tensor's own fingerprint (the integer sum of its bit patterns, masked to 52 bits, as
/// fp64), in `params` order, on their device; 0 for undefined and non-floating tensors. For the
/// rare step a replica diverged: gathered from every rank, it names the tensors that differ.
at::Tensor tensor_fingerprints(const std::vector<at::Tensor>& params);

/// The indices of the tensors whose fingerprint on one of `diverged` ranks differs from the
/// other ranks' majority, from the gathered rows (world_size x count, rank order).
std::vector<std::size_t> diverged_tensors(const std::vector<double>& rows, int world_size,
                                          std::size_t count, const std::vector<int>& diverged);

}  // namespace consensus
}  // namespace stepguard
