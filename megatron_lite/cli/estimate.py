"""``megatron-lite estimate``: per-rank memory and FLOPs per step of a training config, before running it.

    megatron-lite estimate --config examples/configs/gpt_tiny.yaml
    megatron-lite estimate --config run.yaml --devices 8 --json

Reads the same YAML as ``megatron-lite fit`` (``model.config``, ``model.optimizer``, ``data.init_args``
micro/global batch size and seq_length, ``trainer`` devices/num_nodes/precision/accelerator and the
strategy's ``init_args``) and prints, per rank: parameters, bytes of weights, gradients, optimizer state
(with and without the distributed optimizer), activations (with the recompute and sequence-parallel
settings), the total, and the model FLOPs of one step -- both for the model's objective
(``model.class_path``: a DPO pair is two sequences plus the reference model's forward and weights, a GRPO
prompt ``group_size`` sequences; see ``objective_cost``). Under pipeline parallelism (the strategy's
pipeline options: sizes, schedule, uneven cut) the details are the most loaded stage's, followed by one
line per stage (``stages`` in the JSON). Under context parallelism (``context_parallel_size``,
``cp_comm_type``) activations are those of ``seq_length / C`` tokens plus the keys/values in flight. For a
Mixture-of-Experts model (``num_moe_experts``; the strategy's ``expert_model_parallel_size`` and
``expert_tensor_parallel_size``) each rank holds its experts split over EP x ETP, their optimizer state sharded over
expert-DP, and the activations of balanced routing; FLOPs count the active (top-k) experts. With a LoRA callback in
``trainer.callbacks`` (``megatron_lite.callbacks.LoRA``) the base is frozen: gradients and optimizer state are the
adapters', and the FLOPs leave out the base's weight gradients. Exit code 2 on bad input, with one line that says
what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from megatron_lite.cli.command import report_user_error
from megatron_lite.core.estimator.flops import training_flops_per_step
from megatron_lite.core.estimator.memory import MemoryEstimate
from megatron_lite.core.estimator.objective_cost import ObjectiveCost, objective_cost
from megatron_lite.core.estimator.report import (  # noqa: F401  (re-exported: the command's API)
    default_device_memory_bytes,
    format_table,
    memory_warning,
)
from megatron_lite.core.estimator.run import estimate_for_run
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.run_checks import check_run_fits_model
from megatron_lite.core.optim.config import OptimizerConfig
from megatron_lite.core.parallel.geometry import DataGeometry, num_microbatches
from megatron_lite.core.parallel.layout import ParallelConfig
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.core.peft.config import LoRAConfig

GIB = 1024**3


class EstimateError(ValueError):
    """Bad input to ``megatron-lite estimate``; the message says what to change."""


@dataclass
class RunDescription:
    """Everything the estimate needs, read from a ``megatron-lite fit`` YAML."""

    config: GPTConfig
    """The model."""
    optimizer: OptimizerConfig
    """The optimizer settings (its kind and the distributed-optimizer switch matter)."""
    spec: RunSpec
    """The run as the strategy would describe it: layout, world size, the data's geometry, precision, FSDP2."""
    device_type: str
    """'cuda' or 'cpu'."""
    vocab_source: str
    """Where the vocabulary size came from."""
    objective: ObjectiveCost = ObjectiveCost()
    """What one sample costs the model's objective (sequences, extra forwards, frozen reference models)."""
    objective_name: str = "GPTModule"
    """The model's class (the objective)."""
    lora: Optional[LoRAConfig] = None
    """The adapters of a LoRA callback in ``trainer.callbacks`` (the base frozen); None: every parameter trains."""


def _init_args(node: Any) -> dict:
    """``{class_path, init_args}`` or a plain mapping -> the arguments; anything else -> {}."""
    if isinstance(node, dict):
        return dict(node.get("init_args") or {}) if "class_path" in node else dict(node)
    return {}


def _build_dataclass(cls, values: dict, where: str):
    """``cls(**values)``, with unknown keys reported in one line (the dataclass validates the values)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise EstimateError(f"{where} has unknown keys {unknown}; valid keys are {sorted(known)}")
    return cls(**values)


def _import_class(node: Any, where: str) -> Optional[type]:
    """The class ``node['class_path']`` names (None without one)."""
    if not isinstance(node, dict) or "class_path" not in node:
        return None
    module_name, _, class_name = str(node["class_path"]).rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise EstimateError(f"cannot import {node['class_path']!r} ({err}); fix {where}.class_path") from err


def _class_defaults(node: Any) -> dict:
    """Defaults of the ``__init__`` of ``node['class_path']`` (e.g. a datamodule's micro_batch_size)."""
    cls = _import_class(node, "data")
    if cls is None:
        return {}
    return {
        name: p.default
        for name, p in inspect.signature(cls).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


class _ConfiguredDataModule:
    """The datamodule as the YAML configures it, for what an objective's cost reads of it (``pack_sequences``,
    whether it serves prompts): its arguments with the class's defaults, else the class's attributes."""

    def __init__(self, cls: Optional[type], arguments: dict) -> None:
        self.__dict__.update(arguments, _cls=cls)

    def __getattr__(self, name: str) -> Any:  # only names that are no argument
        return getattr(self.__dict__["_cls"] or object, name)


def _dataclass_in(hint: Any) -> Optional[type]:
    """The dataclass a parameter's type names (``GRPOConfig``, ``Optional[GRPOConfig]``), else None."""
    for kind in (hint, *typing.get_args(hint)):
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            return kind
    return None


def _objective(model: Any, config: GPTConfig, optimizer: OptimizerConfig) -> Any:
    """The model's LightningModule as ``megatron-lite fit`` builds it (no weights: they are built at launch),
    with its dataclass arguments (``grpo``) built from their mappings."""
    from megatron_lite.module import GPTModule

    cls = _import_class(model, "model") or GPTModule
    arguments = {**_init_args(model), "config": config, "optimizer": optimizer}
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: pass the values as they are
        hints = {}
    for name, value in arguments.items():
        kind = _dataclass_in(hints.get(name))
        if kind is not None and isinstance(value, dict):
            arguments[name] = _build_dataclass(kind, _init_args(value), f"model.{name}")
    try:
        return cls(**arguments)
    except TypeError as err:
        raise EstimateError(f"{cls.__name__} does not take the arguments of model.init_args ({err}); fix them") from err


def _lora(trainer: dict) -> Optional[LoRAConfig]:
    """The configuration of the LoRA callback among ``trainer.callbacks`` (None without one)."""
    from megatron_lite.callbacks.lora import LoRA

    callbacks = trainer.get("callbacks") or []
    for node in [callbacks] if isinstance(callbacks, dict) else callbacks:
        cls = _import_class(node, "trainer.callbacks")
        if isinstance(cls, type) and issubclass(cls, LoRA):
            try:
                return cls(**_init_args(node)).config
            except TypeError as err:
                raise EstimateError(
                    f"{cls.__name__} does not take the init_args given ({err}); fix trainer.callbacks"
                ) from err
    return None


def _vocab_size(data: dict, data_defaults: dict, model_config: dict, override: Optional[int]) -> tuple:
    """(vocabulary size, where it came from), in the order the run resolves it."""
    if override is not None:
        return override, "--vocab-size"
    tokenizer, model_file = data.get("tokenizer"), data.get("tokenizer_model")
    try:  # any failure to build the tokenizer has the same fix
        if isinstance(tokenizer, dict) and "class_path" in tokenizer:
            module_name, _, class_name = tokenizer["class_path"].rpartition(".")
            cls = getattr(importlib.import_module(module_name), class_name)
            return int(cls(**_init_args(tokenizer)).vocab_size), "data tokenizer"
        if model_file:
            from megatron_lite.tokenizers import SentencePieceTokenizer

            return SentencePieceTokenizer(model_file).vocab_size, "data.init_args.tokenizer_model"
    except Exception as err:  # noqa: BLE001
        raise EstimateError(
            f"could not build the data's tokenizer to read its vocabulary size "
            f"({' '.join(str(err).split())}); fix its paths or pass --vocab-size"
        ) from err
    if data.get("vocab_size") is not None:
        return int(data["vocab_size"]), "data.init_args.vocab_size"
    if data_defaults.get("vocab_size") is not None:
        return int(data_defaults["vocab_size"]), "the datamodule's default vocab_size"
    if model_config.get("vocab_size") is not None:
        return int(model_config["vocab_size"]), "model.config.vocab_size"
    return GPTConfig.vocab_size, "GPTConfig's default vocab_size"


def _world_size(trainer: dict, devices: Optional[int], num_nodes: Optional[int]) -> int:
    per_node = devices if devices is not None else trainer.get("devices", "auto")
    if isinstance(per_node, (list, tuple)):
        per_node = len(per_node)
    elif isinstance(per_node, str) and per_node.strip().lstrip("-").isdigit():
        per_node = int(per_node)
    if not isinstance(per_node, int) or isinstance(per_node, bool) or per_node < 1:
        raise EstimateError(
            f"trainer.devices is {per_node!r}: the estimate needs a number of devices; "
            f"set trainer.devices or pass --devices N"
        )
    nodes = num_nodes if num_nodes is not None else int(trainer.get("num_nodes", 1) or 1)
    return per_node * nodes


def _optional_int(value: Any) -> Optional[int]:
    return None if value is None else int(value)


def describe_run(
    raw: dict,
    *,
    devices: Optional[int] = None,
    num_nodes: Optional[int] = None,
    vocab_size: Optional[int] = None,
    device_type: Optional[str] = None,
) -> RunDescription:
    """Read a parsed ``megatron-lite fit`` YAML (overrides as the command-line flags give them)."""
    if not isinstance(raw, dict):
        raise EstimateError("the config file must be a YAML mapping with model/data/trainer sections")
    model = _init_args(raw.get("model"))
    model_config = _init_args(model.get("config"))
    data_node = raw.get("data") or {}
    data = _init_args(data_node)
    data_defaults = (
        _class_defaults(data_node)
        if any(k not in data for k in ("micro_batch_size", "global_batch_size", "seq_length", "vocab_size"))
        else {}
    )
    trainer = raw.get("trainer") or {}
    strategy = _init_args(trainer.get("strategy"))

    geometry = {}
    for key in ("micro_batch_size", "global_batch_size", "seq_length"):
        value = data.get(key, data_defaults.get(key))
        if key == "seq_length" and value is None:
            value = model_config.get("seq_length", GPTConfig.seq_length)
        if value is None:
            raise EstimateError(f"data.init_args.{key} is not set; add it to the config")
        geometry[key] = int(value)
    vocab, vocab_source = _vocab_size(data, data_defaults, model_config, vocab_size)
    # The CLI links the data's seq_length and vocabulary into the model config.
    model_config.update(seq_length=geometry["seq_length"], vocab_size=vocab)
    config = _build_dataclass(GPTConfig, model_config, "model.config")
    optimizer = _build_dataclass(OptimizerConfig, _init_args(model.get("optimizer")), "model.optimizer")
    objective = _objective(raw.get("model"), config, optimizer)
    data_class = _import_class(data_node, "data")
    cost = objective_cost(objective, _ConfiguredDataModule(data_class, {**_class_defaults(data_node), **data}))
    accelerator = str(trainer.get("accelerator", "auto"))
    if device_type is None:
        if accelerator == "auto":
            import torch

            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        else:
            device_type = "cpu" if accelerator == "cpu" else "cuda"
    parallel = ParallelConfig(
        tensor_model_parallel_size=int(strategy.get("tensor_model_parallel_size", 1)),
        pipeline_model_parallel_size=int(strategy.get("pipeline_model_parallel_size", 1)),
        virtual_pipeline_model_parallel_size=int(strategy.get("virtual_pipeline_model_parallel_size", 1)),
        pipeline_schedule=strategy.get("pipeline_schedule"),
        num_layers_in_first_pipeline_stage=_optional_int(strategy.get("num_layers_in_first_pipeline_stage")),
        num_layers_in_last_pipeline_stage=_optional_int(strategy.get("num_layers_in_last_pipeline_stage")),
        pipeline_model_parallel_layout=strategy.get("pipeline_model_parallel_layout"),
        sequence_parallel=bool(strategy.get("sequence_parallel", False)),
        context_parallel_size=int(strategy.get("context_parallel_size", 1)),
        cp_comm_type=str(strategy.get("cp_comm_type", "p2p")),
        cp_fused_blocks=bool(strategy.get("cp_fused_blocks", True)),
        expert_model_parallel_size=int(strategy.get("expert_model_parallel_size", 1)),
        expert_tensor_parallel_size=_optional_int(strategy.get("expert_tensor_parallel_size")),
    )
    world_size = _world_size(trainer, devices, num_nodes)
    # at this data-parallel size first: the geometry alone would name the fix for one rank
    num_microbatches(
        geometry["global_batch_size"], geometry["micro_batch_size"], parallel.data_parallel_size(world_size)
    )
    batches = DataGeometry(
        geometry["micro_batch_size"],
        geometry["global_batch_size"],
        geometry["seq_length"],
        rampup_batch_size=data.get("rampup_batch_size"),
    )  # a ramp-up is checked, not estimated
    spec = RunSpec(
        parallel=parallel,
        world_size=world_size,
        data=batches,
        precision=str(trainer.get("precision", "32-true")),
        use_torch_fsdp2=bool(strategy.get("use_torch_fsdp2", False)),
    )
    return RunDescription(
        config=config,
        optimizer=optimizer,
        spec=spec,
        device_type=device_type,
        vocab_source=vocab_source,
        objective=cost,
        objective_name=type(objective).__name__,
        lora=_lora(trainer),
    )


def estimate_run(run: RunDescription) -> tuple[MemoryEstimate, float]:
    """(per-rank memory estimate, model FLOPs per step) of ``run``; ValueError naming the fix if invalid."""
    spec = run.spec
    check_run_fits_model(spec, run.config)
    estimate = estimate_for_run(
        run.config, spec, run.optimizer, device_type=run.device_type, objective=run.objective, lora=run.lora
    )
    assert spec.data is not None  # describe_run always reads the geometry
    flops = training_flops_per_step(
        run.config,
        spec.data.global_batch_size,
        spec.data.seq_length,
        tensor_model_parallel_size=spec.parallel.tensor_model_parallel_size,
        cost=run.objective,
        lora=run.lora,
    )
    return estimate, flops


def build_parser() -> argparse.ArgumentParser:
    """The ``megatron-lite estimate`` argument parser."""
    p = argparse.ArgumentParser(prog="megatron-lite estimate", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a `megatron-lite fit` YAML config")
    p.add_argument("--devices", type=int, help="devices per node (overrides trainer.devices)")
    p.add_argument("--num-nodes", type=int, help="nodes (overrides trainer.num_nodes)")
    p.add_argument("--vocab-size", type=int, help="vocabulary size (overrides what the data config gives)")
    p.add_argument(
        "--device-type", choices=("cuda", "cpu"), help="whose kernels to assume (default: from trainer.accelerator)"
    )
    p.add_argument(
        "--device-memory-gib",
        type=float,
        help="warn when the per-rank total exceeds this (default: the CUDA device's memory, if any)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-lite estimate ...``: 0 on success, 2 on bad input (one line on stderr)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        path = Path(args.config)
        if not path.is_file():
            raise EstimateError(
                f"config file {str(path)!r} does not exist; pass the path of a `megatron-lite fit` YAML"
            )
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise EstimateError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from err
        run = describe_run(
            raw,
            devices=args.devices,
            num_nodes=args.num_nodes,
            vocab_size=args.vocab_size,
            device_type=args.device_type,
        )
        estimate, flops = estimate_run(run)
    except (ValueError, TypeError, OSError) as err:
        return report_user_error("megatron-lite estimate", err)
    device_memory = (
        args.device_memory_gib * GIB if args.device_memory_gib is not None else default_device_memory_bytes()
    )
    warning = memory_warning(estimate, device_memory)
    world = run.spec.world_size
    if args.json:
        out = estimate.to_dict()
        out.update(
            flops_per_step=flops,
            flops_per_rank_per_step=flops / world,
            world_size=world,
            vocab_size=run.config.vocab_size,
            padded_vocab_size=run.config.padded_vocab_size(run.spec.parallel.tensor_model_parallel_size),
            vocab_size_source=run.vocab_source,
            device_memory_bytes=device_memory,
            warning=warning,
            objective=run.objective_name,
            objective_cost=dataclasses.asdict(run.objective),
        )
        print(json.dumps(out, indent=2))
    else:
        print(f"megatron-lite estimate: {args.config} (vocabulary {run.config.vocab_size} from {run.vocab_source})")
        if run.objective != ObjectiveCost():
            c = run.objective
            print(
                f"objective {run.objective_name}: a sample is {c.sequences_per_sample} sequence(s), each trained "
                f"{c.training_passes}x and run forward-only {c.forward_only_passes}x per step; "
                f"{c.frozen_models} frozen reference model(s)"
            )
        print(format_table(estimate, flops))
    if warning:
        print(warning, file=sys.stderr)
    return 0
