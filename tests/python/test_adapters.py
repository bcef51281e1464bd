"""The Megatron-style and DeepSpeed-style adapters, driven with the call sequence each framework
makes (Megatron-LM training.py train_step; DeepSpeed engine.backward/step/_take_model_step)."""

import torch

import stepguard
from stepguard.adapters import DeepSpeedOptimizerProxy, MegatronOptimizerAdapter
from conftest import loss_of, make_model


class FakeMegatronOptimizer:
    """The MegatronOptimizer contract the adapter relies on, without a grad scaler (bf16/fp32):
    prepare_grads() copies model grads to the main grads and returns found_inf (False);
    step_with_ready_grads() steps the inner optimizer and copies main params back."""

    def __init__(self, model):
        self.model = model
        self.main = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
        self.optimizer = torch.optim.Adam(self.main, lr=1e-2)
        self.calls = []

    def prepare_grads(self):
        self.calls.append("prepare_grads")
        for m, p in zip(self.main, self.model.parameters()):
            m.grad = None if p.grad is None else p.grad.detach().clone()
        return False

    def clip_grad_norm(self, clip_grad):
        self.calls.append("clip_grad_norm")
        return float(torch.nn.utils.clip_grad_norm_(self.main, clip_grad))

    def step_with_ready_grads(self):
        self.calls.append("step_with_ready_grads")
        self.optimizer.step()
        with torch.no_grad():
            for m, p in zip(self.main, self.model.parameters()):
                p.copy_(m)
        return True

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd)


def test_megatron_train_step_sequence():
    model = make_model(20)
    inner = FakeMegatronOptimizer(model)
    adapter = MegatronOptimizerAdapter(inner, clip_grad=1.0)
    scheduler_increments, skipped = [], 0
    for iteration in range(4):
        adapter.zero_grad()  # train_step: optimizer.zero_grad()
        for micro in range(2):  # forward_backward_func: grad_scale_func on each micro-batch loss
            loss = loss_of(model, 10 * iteration + micro) / 2
            adapter.scale_loss(loss).backward()
        if iteration == 2:
            model[0].weight.grad[0, 0] = float("nan")
        update_successful, grad_norm, num_zeros = adapter.step()
        if update_successful:
            scheduler_increments.append(1)  # opt_param_scheduler.step(increment=...)
        else:
            skipped += 1
            assert grad_norm is None and num_zeros is None
    assert skipped == 1 and len(scheduler_increments) == 3
    assert adapter.last_report.applied
    assert inner.calls.count("step_with_ready_grads") == 3
    assert inner.calls.count("prepare_grads") == 4
    assert inner.calls.count("clip_grad_norm") == 3
    assert float(adapter.get_loss_scale()) == 1.0
    for m, p in zip(inner.main, model.parameters()):
        assert torch.equal(m, p)


def test_deepspeed_take_model_step_sequence():
    model = make_model(21)
    proxy = DeepSpeedOptimizerProxy(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), loss_scaling=True)
    sched = torch.optim.lr_scheduler.StepLR(proxy.guard, step_size=1, gamma=0.9)
    skipped_steps = 0
    for step in range(4):
        loss = loss_of(model, step)
        proxy.backward(loss)  # engine.backward(loss) -> self.optimizer.backward(loss)
        if step == 1:
            model[2].bias.grad[0] = float("inf")
        proxy.step()  # engine._take_model_step: self.optimizer.step()
        proxy.zero_grad()  # fp16/ZeRO: self.optimizer.zero_grad()
        overflow = proxy.overflow if hasattr(proxy, "overflow") else False
        if overflow:
            skipped_steps += 1
        else:
            sched.step()
    assert skipped_steps == 1
    assert proxy.cur_scale == 32768.0  # backed off once from 65536
    assert abs(proxy.param_groups[0]["lr"] - 0.1 * 0.9 ** 3) < 1e-12
