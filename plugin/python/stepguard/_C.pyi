# Type stubs for stepguard._C, the pybind11 module over the C++ step engine. Keep in step with
# plugin/python/bindings.cpp (tests/python/test_api.py checks that every name here exists there).
import datetime
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

class StepguardError(RuntimeError): ...

class ConsensusError(StepguardError):
    step: int
    missing_ranks: List[int]

class GuardOptions:
    """The C++ GuardOptions: one property per option, with its name, type and default."""
    fields: Tuple[str, ...]
    policy: str
    policy_yaml: str
    max_consecutive_bad_steps: int
    loss_scaling: bool
    zero_grad_on_skip: bool
    checkpoint_dir: str
    checkpoint_every: int
    run_id: str
    incident_dir: str
    trace_path: str
    trace_every_step: bool
    max_blamed_tensors: int
    process_group: Optional[Any]
    store: Optional[Any]
    metrics_port: int
    metrics_bind_address: str
    metrics_run_label: str
    sharded_gradients: bool
    # seconds; set with a number or a datetime.timedelta
    collective_timeout: Union[float, datetime.timedelta]
    def __init__(self) -> None: ...

class StepReport:
    """What guard.step() did."""
    @property
    def outcome(self) -> str: ...
    @property
    def applied(self) -> bool: ...
    @property
    def skipped(self) -> bool: ...
    @property
    def rolled_back(self) -> bool: ...
    @property
    def aborted(self) -> bool: ...
    @property
    def step(self) -> int: ...
    @property
    def loss(self) -> Optional[float]: ...
    @property
    def loss_given(self) -> bool: ...
    @property
    def grad_norm(self) -> float: ...
    @property
    def nonfinite_count(self) -> int: ...
    @property
    def actions(self) -> List[str]: ...
    @property
    def action(self) -> str: ...
    @property
    def batches_to_skip(self) -> int: ...
    @property
    def rolled_back_to(self) -> int: ...
    @property
    def loss_scale(self) -> float: ...
    @property
    def lr_factor(self) -> float: ...
    @property
    def incident(self) -> Optional[Dict[str, Any]]: ...

class InputVerdict:
    def __bool__(self) -> bool: ...
    @property
    def problems(self) -> List[str]: ...

class GuardTotals:
    """Running totals by outcome."""
    steps: int
    applied: int
    skipped: int
    rolled_back: int
    aborted: int
    incidents: int
    snapshots: int
    def to_dict(self) -> Dict[str, int]: ...

class StageSeconds:
    """Where one step's time went, stage by stage."""
    inspect: float
    agree: float
    decide: float
    act: float
    snapshot: float
    record: float
    def total(self) -> float: ...
    def to_dict(self) -> Dict[str, float]: ...

class GuardStats:
    """What the guard knows now: the C++ GuardStats, field for field (read-only)."""
    step_count: int
    totals: GuardTotals
    aborted: bool
    consecutive_bad_steps: int
    bad_steps_total: int
    loss_scale: float
    lr_factor: float
    rank: int
    world_size: int
    data_position: int
    skipped_ranges: List[Tuple[int, int]]
    snapshots_held: int
    snapshot_bytes: int
    checkpoints_written: int
    checkpoints_failed: int
    checkpoints_skipped: int
    collective_calls: int
    collective_bytes: int
    step_buffer_bytes: int
    last_step_seconds: StageSeconds
    metrics_endpoint: str
    def to_dict(self) -> Dict[str, Any]: ...

class Guard:
    """The step engine over a torch.optim port (use stepguard.GuardedOptimizer)."""
    def __init__(self, port: Any, options: GuardOptions) -> None: ...
    def step(self, loss: Optional[torch.Tensor] = None) -> StepReport: ...
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...
    def check_inputs(self, inputs: Sequence[torch.Tensor],
                     mask: Optional[torch.Tensor] = None) -> InputVerdict: ...
    def set_replay(self, fn: Optional[Callable[[str], torch.Tensor]]) -> None: ...
    def probe(self, name: str, output: torch.Tensor) -> torch.Tensor: ...
    def track_buffers(self, buffers: Sequence[torch.Tensor]) -> None: ...
    def resume(self, dir: str) -> int: ...
    def commit_pending_checkpoint(self) -> None: ...
    def wait_for_background_work(self) -> None: ...
    def record(self) -> Dict[str, Any]: ...
    def load_record(self, record: Dict[str, Any]) -> None: ...
    def set_data_position(self, position: int) -> None: ...
    def stats(self) -> GuardStats: ...
    def metrics_text(self) -> str: ...

def check_policy_file(path: str) -> List[str]: ...
def explain_policy_file(path: str) -> str: ...
def attach_incident_picture(report_path: str, picture_path: str) -> None: ...
def version() -> str: ...
