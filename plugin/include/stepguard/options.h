/*
 * GuardOptions: how a GuardedOptimizer behaves, as a small struct with chainable setters in the
 * style of torch::optim options. Defaults are visible here and checked when the guard is built.
 */
#pragma once

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>

namespace stepguard {

/// Options of a GuardedOptimizer. A plain value: copy freely; not shared between threads.
struct GuardOptions {
  /// Path of a YAML policy file (see configs/policies/README.md), or the name of a shipped
  /// preset (`default`, `megatron`, `deepspeed-fp16`, `palm-rollback`, `debug-strict`: built in,
  /// found from any directory; a file of that name wins). Empty uses the options below. A bad
  /// file fails the guard's construction with every issue as `file:line:col: message`.
  TORCH_ARG(std::string, policy) = "";
  /// The policy as YAML text instead of a file (e.g. from the job's own config system); errors
  /// name it `policy_yaml`. Set this or policy, not both.
  TORCH_ARG(std::string, policy_yaml) = "";
  /// Abort training after this many consecutive bad (non-finite) steps; 0 never aborts and keeps
  /// skipping. Bounds a loop of futility such as a parameter that became NaN. Set it here or in
  /// the policy file, not both.
  TORCH_ARG(std::int64_t, max_consecutive_bad_steps) = 0;
  /// Dynamic loss scaling for fp16 with PyTorch GradScaler's defaults (init 2^16, x2 every 2000
  /// clean steps, x0.5 on a NaN/Inf step). A policy file's `loss_scale` section, when present,
  /// turns it on (or off) with its own numbers instead. Call backward() on guard.scale_loss(loss).
  TORCH_ARG(bool, loss_scaling) = false;
  /// Zero the gradients of a skipped step, so a loop that forgets zero_grad() cannot carry a NaN
  /// into the next step.
  TORCH_ARG(bool, zero_grad_on_skip) = true;
  /// Where disk checkpoints go (one directory per step, one file per rank, a manifest); empty
  /// writes none. The cadence is checkpoint_every, or the policy's `checkpoint.disk_every`.
  TORCH_ARG(std::string, checkpoint_dir) = "";
  /// Write a disk checkpoint after every N-th applied step (0: the policy's
  /// `checkpoint.disk_every`). A checkpoint becomes visible (its manifest is written) only when the
  /// next step is clean, as RAM snapshots are confirmed.
  TORCH_ARG(std::int64_t, checkpoint_every) = 0;
  /// The run this run's checkpoints belong to (1 to 64 of [A-Za-z0-9._-], the same on every
  /// rank). Empty: resume() adopts the id of the checkpoint it loads, else rank 0 draws one at the
  /// first step. Pruning and resume consider only one run's checkpoints, and the first step
  /// refuses a checkpoint_dir that holds another run's checkpoints unless this run resumed from
  /// it.
  TORCH_ARG(std::string, run_id) = "";
  /// Where incident reports go (incident-step-NNNNNNNNN.json and .md per incident, plus the
  /// batch given to check_inputs as .batch.pt); empty writes none. Each rank writes its own
  /// (rank-<r>- prefix when there are several).
  TORCH_ARG(std::string, incident_dir) = "";
  /// Path of the JSONL event log (the trace); empty writes none.
  TORCH_ARG(std::string, trace_path) = "";
  /// Write a trace line for every step; when false only for steps that were not a plain apply.
  TORCH_ARG(bool, trace_every_step) = true;
  /// At most this many offending tensor names in a report or trace line.
  TORCH_ARG(std::int64_t, max_blamed_tensors) = 8;
  /// The process group the ranks agree through (Gloo on CPU, NCCL on GPUs): typically the one the
  /// training loop already averages gradients with, or init_gloo_process_group(). Empty: one rank.
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, process_group) = {};
  /// The rendezvous store of that group, if any: used only after a failed collective, to name the
  /// ranks that are missing.
  TORCH_ARG(c10::intrusive_ptr<c10d::Store>, store) = {};
  /// TCP port of this guard's Prometheus /metrics endpoint: -1 serves none, 0 picks a free port
  /// (GuardedOptimizer::stats().metrics_endpoint says which). With several ranks on one host, give
  /// each its own (e.g. base + LOCAL_RANK), or -1 on all but rank 0.
  TORCH_ARG(int, metrics_port) = -1;
  /// Address the endpoint binds to: loopback unless told otherwise.
  TORCH_ARG(std::string, metrics_bind_address) = "127.0.0.1";
  /// The `run` label on every metric: names the training job in alerts.
  TORCH_ARG(std::string, metrics_run_label) = "stepguard";
  /// How the gradients are laid out across ranks. false (data parallel, the default): every rank
  /// holds the same averaged gradient, so the global grad norm is one rank's (the mean over ranks
  /// of the sums of squares). true (a sharded optimizer, ZeRO/FSDP): each rank holds a part, so
  /// the global norm sums over ranks. Clipping and the grad-norm detector use this norm.
  TORCH_ARG(bool, sharded_gradients) = false;
  /// Deadline of the per-step collective. A dead or stuck rank makes the others throw
  /// consensus errors naming the step after this long, instead of hanging.
  /// (Python: seconds as a number, or a datetime.timedelta.)
  TORCH_ARG(std::chrono::milliseconds, collective_timeout) = std::chrono::minutes(5);
  /// false: the guard is off and the wrapped optimizer steps as without it (GradScaler's
  /// `enabled=False`): no inspection, no collective and no read per step, no snapshot, trace or
  /// metrics endpoint; reports say `applied` with the grad norm and loss not measured (NaN), the
  /// step count goes on and the guard's state round-trips through state dicts unchanged. Every
  /// rank must agree (checked when the guard is built, the one collective a guard that is off
  /// makes). The policy is still read and checked.
  TORCH_ARG(bool, enabled) = true;
};

}  // namespace stepguard
