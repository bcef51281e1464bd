"""The torchtitan integration's declared seams (stepguard.integrations.torchtitan): what
``GuardedTrainer`` replaces or relies on in torchtitan beyond overriding the Trainer's methods
(torchtitan's documented extension), and the torchtitan functions whose code defines the
behaviour relied on, fingerprinted for the tested release (0.3.0). Merged into
``_seams.SEAMS``/``TESTED_SOURCES`` under "torchtitan"; checked when the trainer is built."""

from ._seams import Seam

_T = "torchtitan.trainer.Trainer."
_U = "torchtitan.distributed.utils."
_O = "torchtitan.components.optimizer.optimizer.OptimizersContainer."
_S = "torchtitan.components.optimizer.lr_scheduler.LRSchedulersContainer."
_C = "torchtitan.components.checkpointer.dcp.CheckpointManager."

TESTED = {  # torchtitan 0.3.0
    _T + "train_step": {"6d0f7ccc832374b9"},
    _T + "forward_backward_step": {"235a302231db2a9f"},
    _T + "state_dict": {"fbdacd36e95697e8"},
    _U + "clip_grad_norm_": {"855978eb27313cfe"},
    _O + "step": {"bc9b3b8d51d711da"},
    _S + "step": {"cedb2e139115054d"},
    _C + "_should_save": {"395dba2e7907c095"},
}

SEAMS = [
    Seam(_U + "clip_grad_norm_", "replaces",
         "the verdict where train_step clips, after every backward and before the update; the "
         "clip from the agreed norm (torchtitan's own with framework_norm); put back when the "
         "step returns", (_T + "train_step", _U + "clip_grad_norm_")),
    Seam(_T + "optimizers", "writes",
         "train_step's optimizers.step() is the update the verdict allows (the container's own "
         "step, with the policy's LR factor); the checkpointer keeps the container",
         (_T + "train_step", _O + "step")),
    Seam(_T + "lr_schedulers", "writes",
         "train_step's lr_schedulers.step() runs after an applied update only (deferred: when "
         "the update is known to stand, inside the next step)",
         (_T + "train_step", _S + "step")),
    Seam(_T + "forward_backward_step", "follows",
         "the step's loss: each micro-batch group's return (the local loss sum over the global "
         "token count), on the last pipeline stage", (_T + "forward_backward_step",),
         restored=False),
    Seam(_T + "train_step", "follows",
         "torchtitan's stop for a non-finite loss comes after the update and the scheduler, so "
         "a step the guard did not apply can pass it", (_T + "train_step",), restored=False),
    Seam(_C + "_should_save", "follows",
         "deferred: the steps the checkpointer saves (its interval, step 1, the last) are "
         "decided before the save", (_C + "_should_save",), restored=False),
    Seam(_T + "state_dict", "follows",
         "the guard's state rides in the trainer's own Stateful state (checkpointer's "
         "train_state)", (_T + "state_dict",), restored=False),
]
