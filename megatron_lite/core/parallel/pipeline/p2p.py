"""Point-to-point transfers between neighbouring pipeline stages.

Activations go to the rank of the next virtual stage and gradients to the rank of the previous one, each on
its own process group, tagged with the receiving virtual stage: the next rank of the pipeline ring (the
previous one for gradients) in Megatron's interleaved placement; in the V placement of the zero-bubble
schedules the second chunk's activations flow back towards rank 0, and the turn between the two chunks of
rank ``P - 1`` is handed over in memory, without a transfer. Sends are asynchronous: each keeps its
tensor until it completes, and completed sends are let go whenever this rank posts or receives a
transfer (all are waited for at the end of the step), so a sent tensor's memory lives as long as its
transfer, not the whole step. A receive can be posted ahead (:meth:`PipelineP2P.post_forward`,
:meth:`PipelineP2P.post_backward`) so that the transfer runs while this rank computes, and is waited
for only when its data is needed: any valid schedule order runs without deadlock. The first forward
transfer to each virtual stage in a step is preceded by a small header (shape and dtype), so stages
need not know each other's activation shapes; later ones in the step have the same shape (all
microbatches of a step do), which lets the receiver post them ahead. A backward transfer has the
shape of the activation it answers, which the receiver holds.
"""

from __future__ import annotations

import queue
import threading
from typing import Optional

import torch
import torch.distributed as dist

from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.timers import Timers, timed

_MAX_DIMS = 6
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


class PipelineP2P:
    """Send/receive activations and gradients between this rank and its pipeline neighbours."""

    def __init__(self, layout: ParallelLayout, device: torch.device, timers: Optional[Timers] = None):
        self.forward_group = layout.group("pp")
        self.backward_group = layout.group("pp_backward")
        assert self.forward_group is not None  # built only under pipeline parallelism (pp_size > 1)
        self._stage_pp_rank = layout.config.stage_pp_rank
        self._pp_rank = layout.pp_rank
        group = self.forward_group
        self._global_ranks = [dist.get_global_rank(group, pp_rank) for pp_rank in range(layout.pp_size)]
        self._local: dict[tuple[str, int], list[torch.Tensor]] = {}  # ("F"/"B", receiving stage) -> in order
        self.device = device
        self.timers = timers
        if timers is not None:  # every stage has every timer, so their cross-rank report lines up
            for name in ("forward-send", "forward-recv", "backward-send", "backward-recv"):
                timers(name, log_level=2)
        self._pending: list = []  # (work, tensor kept alive until the send completes)
        # NCCL's works report completion by themselves; gloo's only once waited for: a thread waits for them.
        self._waits_to_complete = not (device.type == "cuda" and "nccl" in str(dist.get_backend(self.forward_group)))
        self._waiters: dict[tuple[str, int], _SendWaiter] = {}  # (direction, tag) -> its sends' waiter this step
        self._sent_shapes: dict[int, tuple] = {}  # virtual stage -> (shape, dtype) sent this step
        self._recv_shapes: dict[int, tuple] = {}  # virtual stage -> (shape, dtype) received this step

    def _rank(self, virtual_stage: int) -> int:
        """The global rank that holds ``virtual_stage``."""
        return self._global_ranks[self._stage_pp_rank(virtual_stage)]

    def is_local(self, virtual_stage: int) -> bool:
        """Whether ``virtual_stage`` is held by this rank (a hand-over in memory, no transfer)."""
        return self._stage_pp_rank(virtual_stage) == self._pp_rank

    def send_forward(self, tensor: torch.Tensor, to_virtual_stage: int) -> None:
        """Activations for ``to_virtual_stage`` (held by the rank of the next virtual stage)."""
        if self.is_local(to_virtual_stage):
            self._local.setdefault(("F", to_virtual_stage), []).append(tensor.detach())
            return
        with timed(self.timers, "forward-send", log_level=2):
            tensor = tensor.detach().contiguous()
            meta = (tuple(tensor.shape), tensor.dtype)
            known = self._sent_shapes.get(to_virtual_stage)
            if known is None:
                header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64)
                header[0], header[1] = tensor.ndim, DTYPES.index(tensor.dtype)
                header[2 : 2 + tensor.ndim] = torch.tensor(tensor.shape)
                self._isend(header.to(self.device), self._rank(to_virtual_stage), "forward", to_virtual_stage)
                self._sent_shapes[to_virtual_stage] = meta
            elif known != meta:
                raise ValueError(
                    f"pipeline activations changed shape within a step ({known} then {meta}): every "
                    f"microbatch of a step must have the same shape"
                )
            self._isend(tensor, self._rank(to_virtual_stage), "forward", to_virtual_stage)

    def forward_shape_known(self, virtual_stage: int) -> bool:
        """Whether this step's activations for ``virtual_stage`` come by a transfer of known shape (can be posted
        ahead)."""
        return virtual_stage in self._recv_shapes and not self.is_local(virtual_stage - 1)

    def post_forward(self, virtual_stage: int) -> "PostedRecv":
        """Start receiving the previous stage's next activations for ``virtual_stage`` (shape known)."""
        shape, dtype = self._recv_shapes[virtual_stage]
        out = torch.empty(shape, dtype=dtype, device=self.device)
        source = self._rank(virtual_stage - 1)
        return PostedRecv(dist.irecv(out, source, group=self.forward_group, tag=virtual_stage), out)

    def recv_forward(self, virtual_stage: int, posted: Optional["PostedRecv"] = None) -> torch.Tensor:
        """The previous stage's activations for this rank's ``virtual_stage`` (blocks until they arrive)."""
        if self.is_local(virtual_stage - 1):
            return self._local[("F", virtual_stage)].pop(0)
        with timed(self.timers, "forward-recv", log_level=2):
            if posted is not None:
                return self._received(posted.wait())
            if virtual_stage not in self._recv_shapes:
                header = torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=self.device)
                dist.recv(header, self._rank(virtual_stage - 1), group=self.forward_group, tag=virtual_stage)
                header = header.cpu()
                ndim = int(header[0])
                self._recv_shapes[virtual_stage] = (tuple(header[2 : 2 + ndim].tolist()), DTYPES[int(header[1])])
            return self._received(self.post_forward(virtual_stage).wait())

    def send_backward(self, grad: torch.Tensor, to_virtual_stage: int) -> None:
        """The gradient of this stage's input, for ``to_virtual_stage`` (held by the rank of the previous stage)."""
        if self.is_local(to_virtual_stage):
            self._local.setdefault(("B", to_virtual_stage), []).append(grad.detach())
            return
        with timed(self.timers, "backward-send", log_level=2):
            grad = grad.detach().contiguous()
            self._isend(grad, self._rank(to_virtual_stage), "backward", to_virtual_stage)

    def backward_by_transfer(self, virtual_stage: int) -> bool:
        """Whether the gradient of ``virtual_stage``'s output comes by a transfer (can be posted ahead)."""
        return not self.is_local(virtual_stage + 1)

    def post_backward(self, virtual_stage: int, like: torch.Tensor) -> "PostedRecv":
        """Start receiving the gradient of ``like`` (this stage's output) from the next stage."""
        out = torch.empty_like(like, memory_format=torch.contiguous_format)
        source = self._rank(virtual_stage + 1)
        return PostedRecv(dist.irecv(out, source, group=self.backward_group, tag=virtual_stage), out)

    def recv_backward(
        self, virtual_stage: int, like: torch.Tensor, posted: Optional["PostedRecv"] = None
    ) -> torch.Tensor:
        """The gradient of ``like`` (this stage's output) from the next stage (blocks)."""
        if not self.backward_by_transfer(virtual_stage):
            return self._local[("B", virtual_stage)].pop(0)
        with timed(self.timers, "backward-recv", log_level=2):
            return self._received((posted or self.post_backward(virtual_stage, like)).wait())

    def _isend(self, tensor: torch.Tensor, dst: int, direction: str, tag: int) -> None:
        group = self.forward_group if direction == "forward" else self.backward_group
        work = dist.isend(tensor, dst, group=group, tag=tag)
        if self._waits_to_complete:
            # Sends to one (rank, tag) are received, and so complete, in the order they are posted; across
            # tags and directions they need not: one waiter per (direction, tag) sees each as it completes.
            waiter = self._waiters.get((direction, tag))
            if waiter is None:
                waiter = self._waiters[(direction, tag)] = _SendWaiter()
            waiter.add(work)
        self._pending.append((work, tensor))
        self.release_completed()

    def _received(self, tensor: torch.Tensor) -> torch.Tensor:
        self.release_completed()  # while this rank waited, its own sends may have completed
        return tensor

    def release_completed(self) -> None:
        """Let go of the sends that have completed, and so of their tensors (a stage output that was
        deallocated after its send is freed here)."""
        self._pending = [(work, tensor) for work, tensor in self._pending if not work.is_completed()]

    def wait(self) -> None:
        """Complete every send of this step (before its buffers may be reused); the next step starts
        with fresh shape headers."""
        if self._waits_to_complete:
            waiters, self._waiters = list(self._waiters.values()), {}
            for waiter in waiters:  # every send waited for by its waiter (a gloo send must not be waited for twice)
                waiter.close()
        else:
            for work, _ in self._pending:
                work.wait()
        self._pending.clear()
        self._sent_shapes.clear()
        self._recv_shapes.clear()
        self._local.clear()


class _SendWaiter:
    """Waits for sends, in the order they were posted, on a thread of its own (for one step): on a backend
    whose works report completion only once waited for (gloo), each then reports it as soon as the
    transfer is done, and :meth:`PipelineP2P.release_completed` can let its tensor go."""

    def __init__(self) -> None:
        self._works: queue.SimpleQueue = queue.SimpleQueue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="pipeline-send-waiter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            work = self._works.get()
            if work is None:
                return
            try:
                work.wait()
            except BaseException as exc:  # re-raised on the training thread by close()
                self._error = self._error or exc
            del work  # a work holds its tensor: kept here, the last one would outlive its transfer

    def add(self, work) -> None:
        self._works.put(work)

    def close(self) -> None:
        """Return once every added send has completed; raise the first send's error if one failed."""
        self._works.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


class PostedRecv:
    """A receive posted ahead: its buffer and the work to wait for."""

    def __init__(self, work, buffer: torch.Tensor):
        self.work, self.buffer = work, buffer

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer
