/*
 * GuardedOptimizer: the drop-in wrapper a training loop calls instead of optimizer.step().
 *
 *   torch::optim::AdamW adamw(model->parameters(), opts);
 *   stepguard::GuardedOptimizer guard(adamw, model->named_parameters());
 *   ...
 *   loss.backward();
 *   auto report = guard.step(loss);   // inspect, agree, decide, act, record
 *   if (report.aborted()) break;
 *
 * The user keeps their optimizer; the guard holds a reference to it and to its parameters. It
 * orchestrates the engine modules and owns the step counter. Not thread-safe: one training thread
 * drives one guard.
 */
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "stepguard/guard_stats.h"
#include "stepguard/input_verdict.h"
#include "stepguard/layout.h"
#include "stepguard/options.h"
#include "stepguard/types.h"

namespace stepguard {

class GuardedOptimizer {
 public:
  /// Guards `optimizer`, which must outlive the guard. Parameters are taken from its param groups
  /// and named "param_<i>" in reports.
  explicit GuardedOptimizer(torch::optim::Optimizer& optimizer, GuardOptions options = {});
  /// As above, with parameter names (e.g. module->named_parameters()) for blame in reports.
  /// Names are matched to the optimizer's parameters by identity; unmatched ones get "param_<i>".
  GuardedOptimizer(torch::optim::Optimizer& optimizer,
                   const torch::OrderedDict<std::string, torch::Tensor>& named_parameters,
                   GuardOptions options = {});
  /// As above, with how the ranks hold each parameter's gradient (stepguard/layout.h): one
  /// Placement per parameter of the optimizer's param groups, in order. The ranks' lists are
  /// checked against each other here, in one collective (c10::Error on every rank, naming each
  /// rank's counts, when they do not fit together).
  GuardedOptimizer(torch::optim::Optimizer& optimizer,
                   const torch::OrderedDict<std::string, torch::Tensor>& named_parameters,
                   std::vector<Placement> layout, GuardOptions options = {});
  ~GuardedOptimizer();
  GuardedOptimizer(const GuardedOptimizer&) = delete;
  GuardedOptimizer& operator=(const GuardedOptimizer&) = delete;

  /// Replaces optimizer.step(): inspects every gradient and the loss, agrees across ranks, and
  /// applies the optimizer step or not as the policy decides. `loss` is a floating-point tensor
  /// with one element on the gradients' device; without one (step()) the guard decides on the
  /// gradients alone and the loss detectors see no value this step (report.loss_given is
  /// false). Throws c10::Error on bad input (nothing changed) and after an abort
  /// (stats().aborted).
  StepReport step(const torch::Tensor& loss = {});
  /// The step in two phases, for a loop that runs the update itself: verdict() inspects, agrees
  /// and decides, changing no parameter and no optimizer state; when verdict.applies() the loop
  /// runs its update (every learning rate times verdict.lr_factor, clip_gradients() for the
  /// policy's clip, its own clip given verdict.grad_norm as the total norm); settle(verdict,
  /// applied) then restores, drops the gradients, snapshots, checkpoints and reports. Nothing
  /// of the guard's but stats() in between. A second verdict() before settle(), or settle()
  /// without a verdict or with another step's: c10::Error, nothing changed. step() is exactly
  /// verdict(), optimizer().step() with the factor, settle().
  Verdict verdict(const torch::Tensor& loss = {});
  StepReport settle(const Verdict& verdict, bool applied);
  /// The policy's clip of `verdict` (Action::kClip) on the gradients; nothing otherwise.
  void clip_gradients(const Verdict& verdict);
  /// Gives this step's loss before a framework calls step() without one (a loss given to step()
  /// itself wins). Used by the next step() only.
  void record_loss(const torch::Tensor& loss);

  /// What the guard knows now, as one value: step counter, totals, knobs, data position,
  /// snapshot and checkpoint counts, collectives, last step's stage times (stepguard/
  /// guard_stats.h). Waits for the last step's background snapshot copy (a copy that failed is
  /// reported and counted then).
  GuardStats stats() const;
  /// The exposition text a Prometheus scrape would see now; empty when metrics are off.
  std::string metrics_text() const;
  /// The policy this guard runs, in plain words (`stepguard policy explain`'s text; an
  /// options-made ladder included), as /policy on the metrics endpoint serves it.
  std::string explain_policy() const;

  /// With loss scaling on: `loss` times the current loss scale, to call backward() on (as
  /// GradScaler's scale()); step() then unscales the gradients in its inspection pass. Without
  /// loss scaling: `loss` itself.
  torch::Tensor scale_loss(const torch::Tensor& loss) const;
  /// Checks the batch about to be trained on, cheaply enough for every step: NaN/Inf in floating
  /// inputs, and with a mask (true = a real token, shape [batch, sequence]) empty or all-masked
  /// rows. The result is evidence for this step's incident, if there is one (a bad batch is a
  /// `data` cause, and the rank it came from is named on every rank), and the inputs are saved
  /// with the incident report. Device ops only: whether the batch is bad rides in the step's one
  /// collective. The verdict converts to true when the batch looks fine (reading the counts
  /// then, once); ignoring it costs no read. No collective of its own.
  InputVerdict check_inputs(const std::vector<torch::Tensor>& inputs,
                            const torch::Tensor& mask = {});
  /// Opt-in replay for forensics: a closure that recomputes this step's loss from the same batch
  /// and runs backward as the training loop does (scaled by scale_loss() in kAsIs, unscaled and
  /// in fp32 in kFp32), returning the loss. On a NaN/Inf step the guard replays the batch from the
  /// pre-step state: as is (a finite result means a hardware suspect), in fp32 when loss scaling
  /// is on (finite means precision overflow), and under anomaly mode (naming the op that made
  /// the first NaN in backward), at the first step of a streak of bad steps. Rank-local: the
  /// closure must not call collectives. Parameters,
  /// optimizer state and the CPU RNG are left as they were; gradients are overwritten.
  void set_replay(std::function<torch::Tensor(ReplayMode)> recompute);
  /// Opt-in probe for forensics, for debugging runs: wrap a module's output inside forward,
  ///   x = guard.probe("blocks.0", block->forward(x));
  /// It records whether the output is finite (in call order) and, through a tensor hook, whether
  /// its gradient is (in backward order). On an incident the evidence names the first probe
  /// where values went bad, forward and backward. Returns `output` itself. Costs a device-to-host
  /// read per probe and step.
  torch::Tensor probe(const std::string& name, const torch::Tensor& output);
  /// Module buffers (e.g. module->named_buffers(): batch-norm running statistics) that RAM
  /// snapshots and disk checkpoints hold and restore along with the parameters. Call it before
  /// the first step; checkpoints record the buffers tracked when they were written.
  void track_buffers(const torch::OrderedDict<std::string, torch::Tensor>& named_buffers);
  /// Restores the newest checkpoint under `dir` that is valid on every rank (checksums verified,
  /// the ranks agree on the step through the consensus layer; a corrupt or incomplete one falls
  /// back to the next older). Parameters, optimizer state, RNG, the decision state, the step
  /// counter, the data position and totals come back. Returns the step resumed from, or 0 when
  /// there is no valid checkpoint (nothing changes). Call it on every rank before the first step.
  std::int64_t resume(const std::string& dir);
  /// Sets the data position stats().data_position reports and checkpoints save (batches
  /// consumed, counted one per step() plus every batches_to_skip the guard asked for). A loop that
  /// consumes several batches per step can keep its own count instead.
  void set_data_position(std::int64_t position);
  /// Makes the checkpoint written after the last step visible without waiting for a next step
  /// (normally the next clean step confirms it). Call it at the end of a run that ended well, on
  /// every rank, after every rank has finished its last step (e.g. after a barrier).
  void commit_pending_checkpoint();
  /// Waits for the background work of the last step(): the RAM snapshot copy and this rank's
  /// disk checkpoint write (a failure of either is logged and counted now). step() already waits
  /// for the copy before it changes anything, and so does everything that reads snapshots; call
  /// this before changing parameters or optimizer state in place between steps (loading a state
  /// dict, weight surgery), or to see a write's outcome at once (tests).
  void wait_for_background_work();

  /// The guard's state and the wrapped optimizer's, as torch's C++ optimizers save theirs (the
  /// same content as state_dict() in Python): under "optimizer" the optimizer's own save(), under
  /// "stepguard" the guard's record (step, data position, decision state, totals, skipped data
  /// ranges), int64 tensors.
  ///   torch::serialize::OutputArchive archive;  guard.save(archive);  archive.save_to(path);
  void save(torch::serialize::OutputArchive& archive) const;
  /// Restores what save() wrote. The guard's record is checked whole first (c10::Error naming the
  /// key, changing nothing, when it is missing, malformed or does not fit this guard's policy);
  /// if the optimizer's part then fails, the guard's comes back as it was. Restoring different
  /// states on different ranks is detected at the next step and aborts training.
  void load(torch::serialize::InputArchive& archive);

  /// The wrapped optimizer.
  torch::optim::Optimizer& optimizer() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace stepguard
