"""stepguard: guards every optimizer step of a PyTorch training loop against NaN/Inf and loss
spikes, agreed across ranks in one collective, with a YAML policy, Prometheus metrics and
incident reports.

    guard = stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4),
                                       model.named_parameters(), policy="run.yaml",
                                       process_group=dist.group.WORLD)
    ...
    guard.scale_loss(loss).backward()
    report = guard.step(loss)
"""

import torch  # noqa: F401  (loads LibTorch before the extension)

from ._C import (ConsensusError, GuardOptions, Placement, StepguardError, StepReport, Verdict,
                 check_policy_file, explain_policy_file, policy_presets, version)
from ._guard import GuardedOptimizer
from ._port import TorchOptimPort

__all__ = [
    "ConsensusError", "GuardOptions", "GuardedOptimizer", "Placement", "StepReport",
    "StepguardError", "TorchOptimPort", "Verdict", "check_policy_file", "explain_policy_file",
    "policy_presets", "version",
]
__version__ = version()
