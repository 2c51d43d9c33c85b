"""The parallel layout: sizes, rank coordinates, DeviceMesh and process groups.

One object, built once by the strategy and passed down explicitly (no module-level globals).
Rank order is Megatron's default ``tp-cp-ep-dp-pp``: TP varies fastest so that tensor-parallel
neighbours share a node, PP varies slowest.

Experts are laid out over the same ranks a second way (Megatron's "MoE parallel folding"): within a
pipeline stage the TP x CP x DP ranks are read again as ETP x EP x EDP (expert tensor, expert and
expert-data parallel), ETP varying fastest. Attention runs on TP x CP x DP x PP, the experts of an MoE
layer on ETP x EP x EDP x PP; expert parameters' gradients are reduced over EDP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from megatron_lite.core.parallel.pipeline_stages import (
    PIPELINE_SCHEDULES,
    V_SHAPED_SCHEDULES,
    PipelineLayout,
    StageChunk,
    pipeline_layout_counts,
    stage_chunks,
    stage_pp_rank,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Mesh dimension names, slowest-varying first (the DeviceMesh convention), i.e. ``tp-cp-dp-pp``
# read right to left (EP is folded into the other dimensions, see EXPERT_MESH_DIMS).
MESH_DIMS = ("pp", "dp", "cp", "tp")
# The same ranks seen by the experts of MoE layers, slowest-varying first.
EXPERT_MESH_DIMS = ("pp", "edp", "ep", "etp")
# Ways context-parallel attention exchanges keys and values (Megatron's --cp-comm-type).
CP_COMM_TYPES = ("p2p", "all_gather")


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes; the data-parallel size follows from the world size."""

    tensor_model_parallel_size: int = 1
    """Ranks that split each layer's weights (Megatron TP)."""
    pipeline_model_parallel_size: int = 1
    """Ranks that split the layers into stages (Megatron PP)."""
    context_parallel_size: int = 1
    """Ranks that split the sequence inside attention (Megatron CP)."""
    expert_model_parallel_size: int = 1
    """Ranks that split the experts of MoE layers (Megatron EP), folded into TP x CP x DP."""
    expert_tensor_parallel_size: Optional[int] = None
    """Ranks that split each expert's weights (Megatron ETP); None means tensor_model_parallel_size."""
    sequence_parallel: bool = False
    """Shard activations outside TP regions along the sequence (needs TP > 1)."""
    virtual_pipeline_model_parallel_size: int = 1
    """Model chunks (virtual stages) per pipeline rank, for the interleaved schedule (Megatron VPP)."""
    pipeline_schedule: Optional[str] = None
    """'1f1b', 'interleaved_1f1b' or 'gpipe'; None means 1f1b (interleaved_1f1b with virtual stages)."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers of the first pipeline stage for an uneven cut (the others share the rest evenly)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers of the last pipeline stage for an uneven cut."""
    pipeline_model_parallel_layout: Optional[PipelineLayout] = None
    """Megatron's layout of the layers over the P x V virtual stages, e.g. ``"E|tt|tt|L"`` (a list of lists is kept
    as a tuple of tuples); replaces the even/uneven cut."""
    layout_layer_counts: Optional[tuple[int, ...]] = field(default=None, init=False, repr=False, compare=False)
    """Transformer layers of each virtual stage, parsed once from ``pipeline_model_parallel_layout`` (None without)."""
    cp_comm_type: str = "p2p"
    """How context-parallel attention gets the other ranks' keys/values: 'p2p' (passed around the CP
    ring, the next block in flight while the current one is computed) or 'all_gather' (all at once)."""
    cp_fused_blocks: bool = True
    """Context-parallel attention computes its blocks with a fused kernel returning the log-sum-exp (CPU flash,
    CUDA memory-efficient SDPA); False: the math path that materializes each block's scores (for debugging)."""

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        etp = self.expert_tensor_parallel_size
        if etp is not None and (not isinstance(etp, int) or isinstance(etp, bool) or etp < 1):
            raise ValueError(f"expert_tensor_parallel_size must be a positive integer or None, got {etp!r}.")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "sequence_parallel=True needs tensor_model_parallel_size > 1 (sequence parallelism "
                "shards the activations of the tensor-parallel group); set sequence_parallel=False "
                "or raise tensor_model_parallel_size."
            )
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {self.cp_comm_type!r}.")
        self._validate_pipeline()

    def _validate_pipeline(self) -> None:
        pp, vpp, schedule = (
            self.pipeline_model_parallel_size,
            self.virtual_pipeline_model_parallel_size,
            self.pipeline_schedule,
        )
        if not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 1:
            raise ValueError(f"virtual_pipeline_model_parallel_size must be a positive integer, got {vpp!r}.")
        if vpp > 1 and pp == 1:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 (virtual "
                f"stages interleave chunks over pipeline ranks); raise pipeline_model_parallel_size or set it to 1."
            )
        if schedule is not None and schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"pipeline_schedule must be one of {PIPELINE_SCHEDULES} (or None for the default), got {schedule!r}."
            )
        if schedule in V_SHAPED_SCHEDULES and vpp != 2:
            raise ValueError(
                f"pipeline_schedule={schedule!r} runs two model chunks per rank in a V; set "
                f"virtual_pipeline_model_parallel_size=2 (got {vpp}), or use 'zb1p' with one chunk per rank."
            )
        if schedule == "interleaved_1f1b" and vpp == 1:
            raise ValueError(
                "pipeline_schedule='interleaved_1f1b' needs virtual_pipeline_model_parallel_size > 1; "
                "set it (e.g. 2) or use pipeline_schedule='1f1b'."
            )
        if schedule in ("1f1b", "gpipe", "zb1p") and vpp > 1:
            raise ValueError(
                f"pipeline_schedule={schedule!r} runs one model chunk per rank, but "
                f"virtual_pipeline_model_parallel_size={vpp}; use pipeline_schedule='interleaved_1f1b' or drop the "
                f"virtual stages."
            )
        if schedule is not None and pp == 1:
            raise ValueError(f"pipeline_schedule={schedule!r} needs pipeline_model_parallel_size > 1.")
        self._parse_pipeline_layout()

    def _parse_pipeline_layout(self) -> None:
        layout = self.pipeline_model_parallel_layout
        if layout is None:
            return
        if self.pipeline_model_parallel_size == 1:
            raise ValueError(
                "pipeline_model_parallel_layout needs pipeline_model_parallel_size > 1 (it places the layers on "
                "pipeline stages); raise pipeline_model_parallel_size or drop the layout."
            )
        if self.num_layers_in_first_pipeline_stage is not None or self.num_layers_in_last_pipeline_stage is not None:
            raise ValueError(
                "pipeline_model_parallel_layout replaces num_layers_in_first/last_pipeline_stage (the layout gives "
                "every stage's layers); drop one or the other."
            )
        counts = pipeline_layout_counts(
            layout, self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        )
        if not isinstance(layout, str):  # immutable and hashable, as the rest of this frozen config
            object.__setattr__(self, "pipeline_model_parallel_layout", tuple(tuple(stage) for stage in layout))
        object.__setattr__(self, "layout_layer_counts", counts)

    @property
    def schedule(self) -> str:
        """The pipeline schedule that runs: 'none' without PP, else the chosen or default one."""
        if self.pipeline_model_parallel_size == 1:
            return "none"
        if self.pipeline_schedule is not None:
            return self.pipeline_schedule
        return "interleaved_1f1b" if self.virtual_pipeline_model_parallel_size > 1 else "1f1b"

    def stage_chunks(self, num_layers: int, pp_rank: int) -> list[StageChunk]:
        """The (virtual) stages pipeline rank ``pp_rank`` holds for a model of ``num_layers`` layers."""
        return stage_chunks(
            num_layers,
            self.pipeline_model_parallel_size,
            pp_rank,
            self.virtual_pipeline_model_parallel_size,
            self.num_layers_in_first_pipeline_stage,
            self.num_layers_in_last_pipeline_stage,
            self.layout_layer_counts,
            v_shape=self.v_shaped,
        )

    @property
    def v_shaped(self) -> bool:
        """Whether the schedule places each rank's two chunks in a V (zbv, dualpipev)."""
        return self.schedule in V_SHAPED_SCHEDULES

    def stage_pp_rank(self, virtual_stage: int) -> int:
        """The pipeline rank that holds ``virtual_stage``."""
        return stage_pp_rank(virtual_stage, self.pipeline_model_parallel_size, self.v_shaped)

    @property
    def last_stage_pp_rank(self) -> int:
        """The pipeline rank that holds the output layer and the loss (P - 1; rank 0 in a V placement)."""
        stages = self.pipeline_model_parallel_size * self.virtual_pipeline_model_parallel_size
        return self.stage_pp_rank(stages - 1)

    @property
    def model_parallel_size(self) -> int:
        """Ranks that together hold one replica of the dense layers (experts are folded into these and DP)."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def etp_size(self) -> int:
        """Expert tensor-parallel size (ETP; TP's when not set)."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size for ``world_size`` ranks, or a ValueError that says what to change."""
        mp = self.model_parallel_size
        if world_size % mp != 0:
            raise ValueError(
                f"The world size ({world_size} processes) must be divisible by the model-parallel size "
                f"tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size = "
                f"{self.tensor_model_parallel_size} x {self.pipeline_model_parallel_size} x "
                f"{self.context_parallel_size} = {mp}; use a number of devices x nodes that is a "
                f"multiple of {mp} or change the parallel sizes."
            )
        self.expert_data_parallel_size(world_size)
        return world_size // mp

    def expert_data_parallel_size(self, world_size: int) -> int:
        """EDP: how many copies of each expert there are per pipeline stage (TP x CP x DP / (ETP x EP)), or a
        ValueError naming the fix."""
        per_stage = world_size // self.pipeline_model_parallel_size
        folded = self.etp_size * self.expert_model_parallel_size
        if world_size % self.pipeline_model_parallel_size or per_stage % folded:
            raise ValueError(
                f"expert_tensor_parallel_size x expert_model_parallel_size = {self.etp_size} x "
                f"{self.expert_model_parallel_size} = {folded} must divide the ranks of a pipeline stage "
                f"(world size {world_size} / pipeline_model_parallel_size {self.pipeline_model_parallel_size}); "
                f"experts are folded into tensor x context x data parallelism, so choose expert sizes whose "
                f"product divides {per_stage} or use more devices."
            )
        return per_stage // folded


@dataclass
class ParallelLayout:
    """Sizes, this rank's coordinates, the DeviceMesh and the process groups of one run.

    Built by :meth:`build` after ``torch.distributed`` is initialised, or :meth:`single` for a
    process that runs alone (no process group needed).
    """

    config: ParallelConfig
    """The model-parallel sizes."""
    world_size: int
    """Total number of ranks."""
    rank: int
    """This process's global rank."""
    mesh: Optional[DeviceMesh] = None
    """torch DeviceMesh with dims ``MESH_DIMS``; None when running alone."""
    coords: dict[str, int] = field(default_factory=dict)
    """This rank's index along each mesh dimension."""
    groups: dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict)
    """Process group per dimension name (and 'mp', 'dp_cp'); None entries mean 'alone'."""
    expert_mesh: Optional[DeviceMesh] = None
    """DeviceMesh with dims ``EXPERT_MESH_DIMS`` over the same ranks; None when the experts are laid out like the
    dense layers (EP = 1 and ETP = TP: their groups are then TP's and DP x CP's)."""
    destroyed: bool = False
    """Whether :meth:`destroy` released the process groups (sizes and coordinates stay readable)."""

    @classmethod
    def single(cls, config: Optional[ParallelConfig] = None) -> "ParallelLayout":
        """A layout for one process: every group has size 1 and no collective is issued."""
        config = config or ParallelConfig()
        if config.model_parallel_size != 1:
            raise ValueError("ParallelLayout.single() needs all model-parallel sizes equal to 1.")
        return cls(
            config=config,
            world_size=1,
            rank=0,
            coords={d: 0 for d in (*MESH_DIMS, *EXPERT_MESH_DIMS)},
            groups={d: None for d in (*MESH_DIMS, *EXPERT_MESH_DIMS, *_FLATTENED_GROUPS)},
        )

    @classmethod
    def build(
        cls, config: ParallelConfig, device_type: str = "cpu", timeout: Optional[timedelta] = None
    ) -> "ParallelLayout":
        """Create the DeviceMesh and the groups over the initialised default process group.

        ``timeout``: how long a collective of every group waits for its peers (the strategy's ``timeout``);
        None: torch's default for new groups (30 min for gloo, 10 for NCCL), not the default group's."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParallelLayout.build() needs torch.distributed to be initialised first.")
        world_size, rank = dist.get_world_size(), dist.get_rank()
        dp = config.data_parallel_size(world_size)
        if world_size == 1:
            return cls.single(config)
        from torch.distributed.device_mesh import init_device_mesh

        shape = (
            config.pipeline_model_parallel_size,
            dp,
            config.context_parallel_size,
            config.tensor_model_parallel_size,
        )
        # DeviceMesh makes its groups with torch's default timeout unless given options that carry one; a
        # dimension spanning every rank reuses the default group, which has the timeout already.
        override: Optional[dict[int | str, Any]] = (
            None
            if timeout is None
            else {name: _group_options(timeout) for name, size in zip(MESH_DIMS, shape) if size < world_size}
        )
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS, backend_override=override or None)
        coords = {name: mesh.get_local_rank(name) for name in MESH_DIMS}
        groups: dict[str, Optional[dist.ProcessGroup]] = {name: mesh.get_group(name) for name in MESH_DIMS}
        # Flattened groups: every rank of one model replica ("mp") and the gradient-reduction group
        # of data plus context parallelism ("dp_cp"), as in Megatron.
        groups["mp"] = _new_subgroups(mesh, ("pp", "cp", "tp"), timeout)
        groups["dp_cp"] = _new_subgroups(mesh, ("dp", "cp"), timeout)
        # The router's groups: token counts over one sequence's ranks (TP x CP) and over a whole stage.
        tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
        if tp > 1 and cp > 1:
            groups["tp_cp"] = _new_subgroups(mesh, ("cp", "tp"), timeout)
        else:
            groups["tp_cp"] = groups["tp"] if tp > 1 else groups["cp"]
        if config.pipeline_model_parallel_size == 1:
            groups["tp_dp_cp"] = dist.group.WORLD
        else:
            groups["tp_dp_cp"] = _new_subgroups(mesh, ("dp", "cp", "tp"), timeout)
        # A second pipeline group for gradients travelling backward: activations and gradients then never
        # share a communicator, so their messages cannot be matched out of order (NCCL ignores tags).
        groups["pp_backward"] = (
            _new_subgroups(mesh, ("pp",), timeout) if config.pipeline_model_parallel_size > 1 else None
        )
        # First and last pipeline stage of one replica: tied embedding weights are summed over it.
        groups["embedding"] = _embedding_subgroups(mesh, timeout) if config.pipeline_model_parallel_size > 1 else None
        expert_mesh = _add_expert_groups(config, groups, coords, rank, world_size, device_type, timeout)
        return cls(
            config=config,
            world_size=world_size,
            rank=rank,
            mesh=mesh,
            coords=coords,
            groups=groups,
            expert_mesh=expert_mesh,
        )

    # --- sizes and ranks -------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        """Tensor-parallel size."""
        return self.config.tensor_model_parallel_size

    @property
    def pp_size(self) -> int:
        """Pipeline-parallel size."""
        return self.config.pipeline_model_parallel_size

    @property
    def cp_size(self) -> int:
        """Context-parallel size."""
        return self.config.context_parallel_size

    @property
    def ep_size(self) -> int:
        """Expert-parallel size."""
        return self.config.expert_model_parallel_size

    @property
    def etp_size(self) -> int:
        """Expert tensor-parallel size."""
        return self.config.etp_size

    @property
    def edp_size(self) -> int:
        """Expert data-parallel size: copies of each expert per pipeline stage."""
        return self.config.expert_data_parallel_size(self.world_size)

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group."""
        return self.coords.get("ep", 0)

    @property
    def etp_rank(self) -> int:
        """This rank's index in its expert tensor-parallel group."""
        return self.coords.get("etp", 0)

    @property
    def edp_rank(self) -> int:
        """This rank's index in its expert-data-parallel group (the copies of its experts)."""
        return self.coords.get("edp", 0)

    @property
    def experts_folded(self) -> bool:
        """Whether the experts are laid out differently from the dense layers (EP > 1 or ETP != TP): their
        groups are then new ones, not TP's and DP x CP's."""
        return self.ep_size > 1 or self.etp_size != self.tp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel size."""
        return self.world_size // self.config.model_parallel_size

    @property
    def sequence_parallel(self) -> bool:
        """Whether activations are sharded along the sequence outside TP regions."""
        return self.config.sequence_parallel

    @property
    def tp_rank(self) -> int:
        """This rank's index in its tensor-parallel group."""
        return self.coords.get("tp", 0)

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.coords.get("pp", 0)

    @property
    def cp_rank(self) -> int:
        """This rank's index in its context-parallel group."""
        return self.coords.get("cp", 0)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index."""
        return self.coords.get("dp", 0)

    @property
    def is_first_pipeline_stage(self) -> bool:
        """Whether this rank holds the embedding."""
        return self.pp_rank == 0

    @property
    def is_last_pipeline_stage(self) -> bool:
        """Whether this rank holds the output layer and computes the loss."""
        return self.pp_rank == self.config.last_stage_pp_rank

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        """The process group of dimension ``name``; None when that dimension has size 1."""
        if self.destroyed:
            # None would read as "alone" and silently skip the collective.
            raise RuntimeError(
                f"the process groups of this layout ({self.describe()}) were destroyed when its run "
                f"ended; build the model again under a live layout (a new fit/validate does)"
            )
        return self.groups.get(name)

    def destroy(self) -> None:
        """Destroy the process groups this layout created (the DeviceMesh's groups and the flattened
        'mp' and 'dp_cp' groups), leaving the default process group alone. Idempotent; local (no
        collective). Models built for this layout cannot run collectives afterwards.

        gloo keeps threads and sockets per group; left to the interpreter's exit they are torn down in
        an arbitrary order, which aborted about one 2-rank run in five ("terminate called without an
        active exception")."""
        if self.destroyed or self.mesh is None or not dist.is_initialized():
            self.destroyed = self.destroyed or self.mesh is not None
            return
        seen: set[int] = set()
        groups = [g for g in self.groups.values() if g is not None]
        groups += list(self.mesh.get_all_groups())
        if self.expert_mesh is not None:
            groups += list(self.expert_mesh.get_all_groups())
        for group in groups:
            if id(group) in seen or group is dist.GroupMember.WORLD or group == dist.GroupMember.NON_GROUP_MEMBER:
                continue
            seen.add(id(group))
            dist.destroy_process_group(group)
        self.groups = {name: None for name in self.groups}
        self.mesh = self.expert_mesh = None
        self.destroyed = True

    def describe(self) -> str:
        """One line for logs: sizes and this rank's coordinates."""
        sizes = f"tp={self.tp_size} cp={self.cp_size} dp={self.dp_size} pp={self.pp_size}"
        if self.ep_size > 1 or self.etp_size != self.tp_size:
            sizes += f" | experts: etp={self.etp_size} ep={self.ep_size} edp={self.edp_size}"
        return f"rank {self.rank}/{self.world_size} [{sizes}] coords={self.coords}"


def _add_expert_groups(config, groups, coords, rank, world_size, device_type, timeout):
    """Fill in the expert coordinates and groups ('etp', 'ep', 'edp', 'ep_etp'); returns the expert DeviceMesh, or
    None when the experts are laid out like the dense layers and reuse their groups (no new communicators)."""
    pp, tp = config.pipeline_model_parallel_size, config.tensor_model_parallel_size
    etp, ep = config.etp_size, config.expert_model_parallel_size
    edp = config.expert_data_parallel_size(world_size)
    local = rank % (world_size // pp)  # rank within its pipeline stage (PP varies slowest in both views)
    coords.update(etp=local % etp, ep=(local // etp) % ep, edp=local // (etp * ep))
    if ep == 1 and etp == tp:
        groups.update(etp=groups["tp"], ep=None, ep_etp=groups["tp"], edp=groups["dp_cp"])
        return None
    from torch.distributed.device_mesh import init_device_mesh

    # init_device_mesh numbers ranks row-major over the shape: exactly the folded order (ETP fastest, PP slowest).
    shape = (pp, edp, ep, etp)
    override: Optional[dict[int | str, Any]] = (
        None
        if timeout is None
        else {name: _group_options(timeout) for name, size in zip(EXPERT_MESH_DIMS, shape) if size < world_size}
    )
    expert_mesh = init_device_mesh(
        device_type, shape, mesh_dim_names=EXPERT_MESH_DIMS, backend_override=override or None
    )
    for name in ("etp", "ep", "edp"):
        groups[name] = expert_mesh.get_group(name) if expert_mesh.size(EXPERT_MESH_DIMS.index(name)) > 1 else None
    groups["ep_etp"] = _new_subgroups(expert_mesh, ("ep", "etp"), timeout, EXPERT_MESH_DIMS) if ep * etp > 1 else None
    return expert_mesh


def _group_options(timeout: timedelta):
    """Process-group options carrying ``timeout``, of the default group's backend (NCCL takes only its own)."""
    if "nccl" in str(dist.get_backend()):
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    from torch._C._distributed_c10d import Backend

    return Backend.Options(str(dist.get_backend()), timeout)


def _new_subgroups(mesh, keep: tuple[str, ...], timeout: Optional[timedelta] = None, dims: tuple[str, ...] = MESH_DIMS):
    """The group of ranks that differ from this one only along the ``keep`` dimensions.

    Every rank must call this in the same order (``new_group`` is collective); the rank tensor of
    the mesh gives the partition.
    """
    names = list(dims)
    ranks = mesh.mesh  # tensor of global ranks, dims in MESH_DIMS order
    other = [i for i, n in enumerate(names) if n not in keep]
    kept = [i for i, n in enumerate(names) if n in keep]
    perm = ranks.permute(*other, *kept).reshape(-1, _prod(ranks.shape[i] for i in kept))
    my_group = None
    me = dist.get_rank()
    for row in perm.tolist():
        group = dist.new_group(ranks=row, timeout=timeout, use_local_synchronization=False)
        if me in row:
            my_group = group
    return my_group


def _embedding_subgroups(mesh, timeout: Optional[timedelta] = None):
    """The group of the first and the last pipeline stage that share this rank's other coordinates
    (every rank calls ``new_group`` for every such pair, in the same order)."""
    ranks = mesh.mesh
    pp_last = ranks.permute(*range(1, ranks.ndim), 0).reshape(-1, ranks.shape[0])
    my_group = None
    me = dist.get_rank()
    for row in pp_last.tolist():
        members = [row[0], row[-1]]
        group = dist.new_group(ranks=members, timeout=timeout, use_local_synchronization=False)
        if me in members:
            my_group = group
    return my_group


_FLATTENED_GROUPS = ("mp", "dp_cp", "tp_cp", "tp_dp_cp", "ep_etp", "embedding", "pp_backward")


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out
