"""Adapters that put stepguard where Megatron-LM's and DeepSpeed's training loops expect their
optimizer, written against those frameworks' optimizer interfaces as their source defines them
(Megatron-LM core_v0.15 `megatron/core/optimizer/optimizer.py` and `training.py`; DeepSpeed
v0.16 `runtime/engine.py`). Neither framework can be installed where stepguard is built: the
adapters are tested by driving them with the call sequence each framework makes, not inside the
framework itself.
"""

import torch

from ._guard import GuardedOptimizer
from ._port import TorchOptimPort


class _MegatronPort(TorchOptimPort):
    """The port over a MegatronOptimizer: main params and grads after prepare_grads(); the
    update is clip_grad_norm() (when configured) then step_with_ready_grads()."""

    def __init__(self, megatron_optimizer, clip_grad, named_parameters):
        super().__init__(megatron_optimizer.optimizer, named_parameters)
        self.megatron = megatron_optimizer
        self.clip_grad = clip_grad

    def update(self):
        if self.clip_grad > 0.0:
            self.megatron.clip_grad_norm(self.clip_grad)
        if not self.megatron.step_with_ready_grads():
            raise RuntimeError("stepguard: step_with_ready_grads() reported failure")


class MegatronOptimizerAdapter:
    """Stands where Megatron's ``MegatronOptimizer`` stands in ``train_step``.

    ``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)`` as Megatron's does
    (``(False, None, None)`` for a step the guard did not apply, so ``opt_param_scheduler`` is not
    stepped and the iteration counts as skipped). It drives the inner optimizer through
    ``prepare_grads()`` (model grads to main grads) and ``step_with_ready_grads()``; the guard
    decides in between, on the main grads, in one collective. Give Megatron ``scale_loss`` as its
    ``grad_scale_func``: it records each micro-batch's loss for the guard and applies the guard's
    loss scale. Build the inner optimizer without Megatron's grad scaler (bf16/fp32, or let the
    guard's policy own the fp16 loss scale with a ``loss_scale`` section): two scalers would fight.
    """

    is_stub_optimizer = False

    def __init__(self, megatron_optimizer, named_parameters=None, *, clip_grad=0.0,
                 log_num_zeros_in_grad=False, **guard_options):
        self.inner = megatron_optimizer
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        port = _MegatronPort(megatron_optimizer, clip_grad, named_parameters)
        self.guard = GuardedOptimizer(megatron_optimizer.optimizer, named_parameters, port=port,
                                      **guard_options)
        self._losses = []
        self.last_report = None

    def scale_loss(self, loss):
        self._losses.append(loss.detach().float())
        return self.guard.scale_loss(loss)

    def step(self):
        self.inner.prepare_grads()
        if not self._losses:
            raise RuntimeError("stepguard: no loss recorded for this step: pass the adapter's "
                               "scale_loss as Megatron's grad_scale_func")
        loss = torch.stack(self._losses).mean()
        self._losses = []
        report = self.guard.step(loss)
        self.last_report = report
        if not report.applied:
            return False, None, None
        zeros = self._count_zeros() if self.log_num_zeros_in_grad else 0
        return True, report.grad_norm, zeros

    def _count_zeros(self):
        return sum(int((p.grad == 0).sum()) for g in self.param_groups for p in g["params"]
                   if p.grad is not None)

    # -- what train_step and checkpointing use ------------------------------------------------
    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none)

    def get_loss_scale(self):
        return torch.tensor([self.guard.loss_scale])

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def reload_model_params(self, state_dict=None):
        self.inner.reload_model_params(state_dict)

    def state_dict(self):
        return {"optimizer": self.inner.state_dict(), "stepguard": self.guard._guard.record()}

    def load_state_dict(self, state_dict):
        self.guard._guard.load_record(state_dict["stepguard"])
        self.inner.load_state_dict(state_dict["optimizer"])


class DeepSpeedOptimizerProxy:
    """A proxy for ``engine.optimizer`` in DeepSpeed: the engine calls ``backward(loss)`` and
    ``step()`` on it, then reads ``overflow`` (``_take_model_step``): on a step the guard did not
    apply the proxy sets ``overflow = True``, so the engine counts it in ``skipped_steps`` and does
    not step its LR scheduler. The loss scale is the guard's (``loss_scale``/``cur_scale``). When
    the engine calls ``loss.backward()`` itself (no fp16/bf16/ZeRO wrapper), call
    ``record_loss(loss)`` before ``engine.step()``.
    """

    def __init__(self, optimizer, named_parameters=None, **guard_options):
        self.optimizer = optimizer
        self.guard = GuardedOptimizer(optimizer, named_parameters, **guard_options)
        self.overflow = False
        self._loss = None
        self.last_report = None

    def record_loss(self, loss):
        self._loss = loss.detach().float()

    def backward(self, loss, create_graph=False, retain_graph=False):
        self.record_loss(loss)
        self.guard.scale_loss(loss).backward(create_graph=create_graph, retain_graph=retain_graph)

    def step(self, closure=None):
        if self._loss is None:
            raise RuntimeError("stepguard: no loss recorded for this step (backward() or "
                               "record_loss())")
        report = self.guard.step(self._loss)
        self._loss = None
        self.last_report = report
        self.overflow = not report.applied
        return self.overflow

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def loss_scale(self):
        return self.guard.loss_scale

    @property
    def cur_scale(self):
        return self.guard.loss_scale

    def state_dict(self):
        return self.guard.state_dict()

    def load_state_dict(self, state_dict):
        self.guard.load_state_dict(state_dict)
