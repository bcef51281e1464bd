"""One rank of test_transformers.py, started by torchrun: a tiny GPT-2 (built from a config, no
download) trained by the real transformers.Trainer on CPU with Gloo, guarded by
stepguard.integrations.transformers. The faults are injected here (in the user's own Trainer
subclass and a gradient hook), never in the integration: rank 1's loss is NaN at NAN_STEP; one
element of rank 1's gradient of GRAD_TENSOR is NaN at GRAD_STEP (in backward, before DDP averages
it: both ranks then hold a NaN in that tensor only); rank 0's loss is 1e4 times too large at
SPIKE_STEP. Each rank writes what it saw to OUT/rank<r>.json and its parameters to OUT/rank<r>.pt.

usage: torchrun --nproc_per_node 2 hf_worker.py OUT POLICY [save | resume CHECKPOINT | fp16 |
fp16-twin | ds | ds-zero0 | ds-zero3 | ds-zero2-offload | ds-bf16 | ds-save | ds-resume CHECKPOINT | ds-clean | ds-twin | ds-offload]
(save: a Trainer checkpoint every SAVE_EVERY steps; resume: train(resume_from_checkpoint=...);
fp16: TrainingArguments(fp16=True) with accelerate's GradScaler (see fp16_on_cpu), the schedule
FP16_SCHEDULE, no clip; fp16-twin: the same without stepguard; ds*: the same runs through
DeepSpeed, TrainingArguments(deepspeed=DS_CONFIG) (ZeRO 2, fp32, the Trainer's "auto" values);
ds-zero0: ZeRO 0 (the engine steps the torch optimizer itself); ds-zero3: ZeRO 3;
ds-zero2-offload: ZeRO 2 with the optimizer offloaded to the CPU (the config's AdamW:
DeepSpeedCPUAdam); ds-bf16: ZeRO 2 under
TrainingArguments(bf16=True); ds-clean: no faults and no
clip; ds-twin: the same without stepguard; ds-offload: ZeRO 3 with the
parameters offloaded to CPU, which attach() refuses: the message is written instead of a run)
"""

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from stepguard.integrations.transformers import StepguardCallback

MAX_STEPS = 12
NAN_STEP, NAN_RANK = 3, 1
GRAD_STEP, GRAD_RANK, GRAD_TENSOR = 5, 1, "transformer.h.0.mlp.c_fc.weight"
SPIKE_STEP, SPIKE_RANK = 8, 0
LR = 1e-3
MAX_GRAD_NORM = 0.3  # below every clean norm here: the Trainer clips each step
SAVE_EVERY = 6
# fp16: the scaler's startup overflow streak comes first (INIT_SCALE is far too high), so the
# faults come later; the spike is in the loss's value only (a 1e4 times larger fp16 gradient
# would be one more overflow, the scaler's); no clip, so that the updates do not depend on who
# computed the norm (the twin is compared bit for bit).
# The LR is constant there: with the Trainer's default fused AdamW, accelerate's scaler calls
# the optimizer on an overflow step too (it skips inside) and the twin's schedule would move on
# its overflow steps; the scheduler's step count is compared instead.
FP16_SCHEDULE = {"MAX_STEPS": 20, "NAN_STEP": 11, "GRAD_STEP": 13, "SPIKE_STEP": 16,
                 "MAX_GRAD_NORM": 0.0, "LR_SCHEDULE": "constant"}
LR_SCHEDULE = "linear"
INIT_SCALE = 2.0 ** 24
GROWTH_INTERVAL = 3
DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
             "zero_optimization": {"stage": 2}}


def _ds_config(mode):
    config = json.loads(json.dumps(DS_CONFIG))
    if mode == "offload":  # refused: ZeRO 3 with its parameters offloaded to the CPU
        config["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu"}}
    if mode == "zero0":
        config["zero_optimization"]["stage"] = 0
    if mode == "zero3":
        config["zero_optimization"]["stage"] = 3
    if mode == "zero2-offload":  # ZeRO-Offload: the optimizer steps on the host copies, and is
        # the config's (DeepSpeedCPUAdam, the Trainer's "auto" values), as HF's docs set it up
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
    if mode == "bf16":  # TrainingArguments(bf16=True) fills "auto"
        config["bf16"] = {"enabled": "auto"}
    return config


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n, length, vocab):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class FaultyTrainer(Trainer):
    """The user's own Trainer subclass, with this test's faults in its loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        step, rank = self.state.global_step + 1, self.args.process_index
        if step == NAN_STEP and rank == NAN_RANK:
            loss = loss * float("nan")
        if step == SPIKE_STEP and rank == SPIKE_RANK:
            loss = loss + 1e4 * loss.detach() if self.args.fp16 else loss * 1e4
        return loss


def fp16_on_cpu(trainer):
    """The one mapping of the fp16 runs: what accelerate sets up for fp16=True on a GPU (native
    AMP: fp16 autocast around the model's forward, and torch.amp.GradScaler('cuda') in the
    Trainer's backward and optimizer step), for device 'cpu'. On CPU accelerate sets up neither
    (fp16 there trains in fp32). Before train(), which prepares the model and optimizer."""
    accelerator = trainer.accelerator
    assert accelerator.mixed_precision == "fp16" and accelerator.scaler is None
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE,
                                              growth_interval=GROWTH_INTERVAL)


class Recorder(TrainerCallback):
    """What the guard reported each step, and the gradients the optimizer stepped with."""

    def __init__(self, guard_callback, trainer=None):
        self.sg = guard_callback
        self.trainer = trainer  # fp16: its scaler's scale after each step
        self.steps = []

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        fp16 = {}
        if self.trainer is not None:
            digest = hashlib.sha256()
            for p in model.parameters():
                digest.update(p.detach().numpy().tobytes())
            fp16 = {"scale": self.trainer.accelerator.scaler.get_scale(),
                    "checksum": digest.hexdigest(), "trainer_step": state.global_step + 1,
                    "skipped_by_trainer": self.trainer.accelerator.optimizer_step_was_skipped}
        r = self.sg.last_report if self.sg is not None else None
        if r is None:
            self.steps.append(fp16)
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        stepped = float(torch.nn.utils.get_total_norm(grads)) if grads else None
        self.steps.append(dict(fp16, **{
            "trainer_step": state.global_step + 1, "step": r.step, "outcome": r.outcome,
            "applied": r.applied, "loss": r.loss, "grad_norm": r.grad_norm,
            "actions": list(r.actions), "incident": r.incident and {
                k: r.incident[k] for k in ("step", "signal", "action", "cause", "ranks",
                                           "tensors")},
            "grad_norm_after_step": stepped,
            "loss_scale": r.loss_scale, "rolled_back_to": r.rolled_back_to}))


def main():
    out, policy = sys.argv[1], sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else None
    deepspeed = mode is not None and mode.startswith("ds")
    if deepspeed:
        mode = mode[3:] or None
    resume = sys.argv[4] if mode == "resume" else None
    fp16 = mode in ("fp16", "fp16-twin")
    if fp16:
        globals().update(FP16_SCHEDULE)
    if mode in ("clean", "twin"):  # no faults, no clip: the guarded run is the twin's bitwise
        globals().update(NAN_STEP=0, GRAD_STEP=0, SPIKE_STEP=0, MAX_GRAD_NORM=0.0)
    # torchrun starts each worker in a session of its own: the test kills these on a timeout.
    with open(os.path.join(out, "pid%s" % os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=os.path.join(out, "trainer"), max_steps=MAX_STEPS,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=LR,
        lr_scheduler_type=LR_SCHEDULE, warmup_steps=0, max_grad_norm=MAX_GRAD_NORM,
        logging_steps=1, report_to=[], use_cpu=True, ddp_backend="gloo",
        save_strategy="steps" if mode in ("save", "resume") else "no", save_steps=SAVE_EVERY,
        fp16=fp16, bf16=deepspeed and mode == "bf16",
        deepspeed=_ds_config(mode) if deepspeed else None,
        seed=7, dataloader_num_workers=0, disable_tqdm=True, ddp_find_unused_parameters=False)
    trainer = FaultyTrainer(model=model, args=args, train_dataset=RandomTokens(256, 16, 64))
    rank = args.process_index
    if fp16:
        fp16_on_cpu(trainer)

    def nan_gradient(grad):
        if trainer.state.global_step + 1 == GRAD_STEP and rank == GRAD_RANK:
            grad = grad.clone()
            grad.view(-1)[3] = float("nan")
        return grad

    dict(model.named_parameters())[GRAD_TENSOR].register_hook(nan_gradient)
    # One trace_path for both ranks: rank 0 writes it, rank 1 trace.jsonl.rank1.
    sg = None
    if mode == "offload":
        try:
            StepguardCallback(policy=policy).attach(trainer)
            refused = None
        except ValueError as e:
            refused = str(e)
        with open(os.path.join(out, "rank%d.json" % rank), "w") as f:
            json.dump({"refused": refused, "callbacks": [
                type(c).__name__ for c in trainer.callback_handler.callbacks]}, f)
        return
    if mode not in ("fp16-twin", "twin"):
        sg = StepguardCallback(policy=policy, collective_timeout=60,
                               trace_path=os.path.join(out, "trace.jsonl")).attach(trainer)
    recorder = Recorder(sg, trainer if fp16 else None)
    trainer.add_callback(recorder)
    result = trainer.train(resume_from_checkpoint=resume)

    assert rank == dist.get_rank()
    left = None
    if deepspeed and sg is not None:  # detach() takes the guard out of the engine
        sg.detach()
        engine = trainer.model_wrapped
        left = [n for n in ("backward", "scale", "clip_fp32_gradients") if n in vars(engine)]
        left += ["optimizer.step" for n in ("step",) if n in vars(engine.optimizer)]
        if engine.optimizer is engine.basic_optimizer and "overflow" in vars(engine.optimizer):
            left.append("optimizer.overflow")  # ZeRO 0: the guard gave the torch optimizer one
        # accelerate's wrapper's flag is again what its prepare() computed from the optimizer.
        if vars(trainer.optimizer).get("__has_overflow__") != hasattr(engine.optimizer,
                                                                      "overflow"):
            left.append("wrapper.__has_overflow__")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save(flat, os.path.join(out, "rank%d.pt" % rank))
    record = {
        "rank": rank, "world": dist.get_world_size(),
        "transformers": transformers.__version__,
        "global_step": trainer.state.global_step, "result_step": result.global_step,
        "final_lr": trainer.lr_scheduler.get_last_lr()[0], "lr": LR, "max_steps": MAX_STEPS,
        # (the config's optimizer: accelerate's wrapper around the Trainer's scheduler)
        "scheduler_steps": getattr(trainer.lr_scheduler, "scheduler",
                                   trainer.lr_scheduler).last_epoch,
        "nan_step": NAN_STEP, "nan_rank": NAN_RANK,
        "grad_step": GRAD_STEP, "grad_rank": GRAD_RANK, "grad_tensor": GRAD_TENSOR,
        "spike_step": SPIKE_STEP, "spike_rank": SPIKE_RANK, "max_grad_norm": MAX_GRAD_NORM,
        "totals": sg.guard.stats().totals.to_dict() if sg else None,
        "callback_order": [type(c).__name__ for c in trainer.callback_handler.callbacks],
        "engine": type(trainer.model_wrapped).__name__,
        "skipped_steps": getattr(trainer.model_wrapped, "skipped_steps", None),
        "left_after_detach": left,
        "steps": recorder.steps, "log_history": trainer.state.log_history,
    }
    with open(os.path.join(out, "rank%d.json" % rank), "w") as f:
        json.dump(record, f, default=str)


if __name__ == "__main__":
    main()
    # Leave without interpreter finalization: torch 2.11's Gloo worker thread can drop the last
    # reference to a finished all_gather (the Trainer's loss gather) after the main thread began
    # Py_FinalizeEx; its tensors' decref then takes the GIL, the thread is exited mid-destructor
    # and libstdc++ aborts ("terminate called without an active exception", SIGABRT). It happens
    # with a plain Trainer too, stepguard or not, in about half the runs on 2 cores.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
