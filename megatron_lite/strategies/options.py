"""MegatronStrategy's own options (everything its constructor takes but Lightning's plugins), validated once at
construction, before anything starts. The constructor keeps the arguments, their Megatron names and their defaults
(and documents them for ``megatron-lite fit --help``); the pre-launch checks, the set-up, the launch and the checkpoint
hooks read them here."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Optional, get_args

from megatron_lite.core.parallel.layout import ParallelConfig
from megatron_lite.core.parallel.run_spec import check_bucket_size

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]

# The on/off options: stored as bools whatever truthy value they were given (as the strategy always did).
_SWITCHES = (
    "use_torch_fsdp2",
    "overlap_grad_reduce",
    "log_metrics",
    "exit_signal_handler",
    "async_save",
    "check_memory",
)


@dataclass(frozen=True)
class StrategyOptions:
    """What a MegatronStrategy was asked for (see its docstring for each option's whole meaning)."""

    parallel: ParallelConfig
    """Tensor/sequence/pipeline/context-parallel sizes and options (validated by ParallelConfig itself)."""
    use_torch_fsdp2: bool
    """Shard parameters, gradients and optimizer state over the data-parallel ranks with FSDP2, composed with TP."""
    ddp_bucket_size: Optional[int]
    """Elements per gradient bucket; None: Megatron's default, max(40M, 1M x dp)."""
    overlap_grad_reduce: bool
    """Reduce each gradient bucket over DP asynchronously during the backward of the last microbatch."""
    log_metrics: bool
    """Add a MegatronMetrics callback unless the Trainer has one."""
    exit_signal_handler: bool
    """Add a GracefulExit callback (save, then stop on SIGTERM) where the Trainer has a checkpoint callback."""
    async_save: bool
    """Write the checkpoint callbacks' saves during fit in the background."""
    check_memory: bool
    """Refuse a run whose estimated memory exceeds the machine's before anything is built."""
    process_group_backend: Optional[str]
    """The requested backend of the default process group; None: gloo on CPU, nccl on CUDA."""
    timeout: Optional[timedelta]
    """How long a collective of any of the run's process groups waits for its peers before it fails."""
    start_method: StartMethod
    """How the launching process starts the ranks: 'popen' (re-runs the script), 'fork', 'spawn' or 'forkserver'."""

    def __post_init__(self) -> None:
        if self.start_method not in get_args(StartMethod):
            raise ValueError(
                f"start_method must be 'popen', 'spawn', 'fork' or 'forkserver', got {self.start_method!r}"
            )
        check_bucket_size(self.ddp_bucket_size)
        for name in _SWITCHES:
            object.__setattr__(self, name, bool(getattr(self, name)))  # frozen: set once, here
