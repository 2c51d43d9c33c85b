"""Pretrained weights in and out of a :class:`GPTModule`: HF Llama directories and our own checkpoints.

``GPTModule.from_pretrained(path)`` builds a one-process module (no Trainer, no process group) holding the
weights; under a Trainer at any layout each rank cuts its shards out of that model (``configure_model``
carries a one-process model over into the layout's model). :func:`save_weights_checkpoint` writes a module's
weights as one of our checkpoints (what ``megatron-lite convert --from hf`` produces): the same directory
format as ``trainer.save_checkpoint`` without optimizer or loop state, so ``from_pretrained``,
``validate/test/predict(ckpt_path=...)`` and ``convert --to hf`` read it.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning
import torch
from torch import nn

from megatron_lite.core.checkpoint.adapter_only import recorded_base, without_base
from megatron_lite.core.checkpoint.checkpointer import LAYOUT_RECORD, layout_record
from megatron_lite.core.checkpoint.fingerprint import LoadedWeights, WeightsSource, changed_source
from megatron_lite.core.checkpoint.format.sharded import EMBEDDED_FILES, save_sharded
from megatron_lite.core.checkpoint.full.reader import (
    is_checkpoint_directory,
    read_checkpoint_hparams,
    read_model_tensors,
)
from megatron_lite.core.checkpoint.full.state import load_full_state, persistent_buffers
from megatron_lite.core.checkpoint.hf.directory import (
    CHECKPOINT_SIDE_DIR,
    CONFIG,
    SIDE_FILES,
    interleaved_rope,
    is_hf_directory,
    load_hf,
    read_hf_config,
)
from megatron_lite.core.checkpoint.hf.peft import ADAPTER_CONFIG, load_peft_adapter, read_peft_config
from megatron_lite.core.checkpoint.hf.weights import fit_vocab_rows, raise_shape_mismatch
from megatron_lite.core.checkpoint.remote_source import is_hf_url, local_directory, resolve_remote_checkpoint
from megatron_lite.core.checkpoint.resume.entries import (
    QUANTIZATION_RECIPE,
    compare_entries,
    config_difference,
    read_meta_plain,
)
from megatron_lite.core.checkpoint.state import sharded_model_state
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.draft_head import DRAFT_HEAD_ATTRIBUTE
from megatron_lite.core.object_store import Location, is_remote, location
from megatron_lite.core.optim.config import OptimizerConfig
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import full_shape
from megatron_lite.core.peft import restore_lora
from megatron_lite.tokenizers.build import TOKENIZER_KEY, portable_tokenizer_spec, tokenizer_spec

_VOCAB_PARAMS = ("embedding.weight", "output_layer.weight")


def _saved_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape a checkpoint stores ``param`` at (its global shape, fused blocks as their own dimension, an expert
    weight's for all experts)."""
    shard = getattr(param, "tp_shard", None)
    shape = (
        tuple(param.shape) if shard is None else shard.blocked_view(torch.empty(shard.global_shape, device="meta"))[1]
    )
    experts = getattr(param, "expert_shard", None)
    return tuple(experts.global_shape(shape) if experts is not None else shape)


def _config_with(config: GPTConfig, overrides: dict[str, Any]) -> GPTConfig:
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"unknown GPTConfig field(s) {unknown}; from_pretrained's keyword arguments are GPTConfig "
            f"fields (and optimizer=, seed=)"
        )
    return dataclasses.replace(config, **overrides)


def _load_checkpoint_weights(
    model: nn.Module, path: Location, vocab_size: int, strict: bool, config: GPTConfig, base_loaded: bool = False
) -> None:
    # base_loaded: ``model`` holds the base an adapter-only checkpoint leaves out (its parameters are not missing)
    # A speculative-decoding draft head trained with the model is no part of it (load_draft_head reads it)
    saved = {n: t for n, t in read_model_tensors(path).items() if not n.startswith(DRAFT_HEAD_ATTRIBUTE + ".")}
    if QUANTIZATION_RECIPE in saved:  # a quantized model's checkpoint: its quantizers first, then their tensors
        from megatron_lite.post_training.quantization import restore_from_state

        restore_from_state(model, saved)
    restore_lora(model, saved, ParallelLayout.single())  # a LoRA run's checkpoint: its adapters, then their values
    # parameters, and the persistent buffers a checkpoint holds too (a quantized model's amax and scales)
    params = {**dict(model.named_parameters()), **dict(persistent_buffers(model))}
    mismatch = compare_entries(params, saved)
    if base_loaded:
        mismatch = without_base(mismatch, model)
    if mismatch and strict:
        differ = config_difference(read_meta_plain(path), config)
        raise ValueError(
            f"the checkpoint {path} does not fit the module's model: {mismatch.describe()}"
            f"{f'; it was saved from a model with {differ}' if differ else ''}. Load it with the configuration it "
            f"was saved with, or pass from_pretrained(..., strict=False) to load only the entries both have (the "
            f"others keep their initial values)."
        )
    saved = {n: t for n, t in saved.items() if n in params}
    raise_shape_mismatch(
        {n: tuple(t.shape) for n, t in saved.items()},
        {n: _saved_shape(p) for n, p in params.items() if n in saved},
        f"the checkpoint {path}",
        "the module's config",
        vocab_size=vocab_size,
    )
    full = {}
    for name, tensor in saved.items():
        shape = full_shape(params[name], padded=True)
        # A fused block seen as its own dimension ([2, ffn, h]) is the flat parameter's memory: reshape it back.
        full[name] = tensor.reshape(shape) if tensor.numel() == torch.Size(shape).numel() else tensor
    load_full_state(model, full, vocab_size=vocab_size, strict=strict and not base_loaded)


def _load_adapted(
    cls: type,
    path: Location,
    recorded: WeightsSource,
    base: Optional[str | os.PathLike],
    optimizer: Optional[OptimizerConfig],
    seed: Optional[int],
    strict: bool,
    overrides: dict[str, Any],
):
    """The module of an adapter-only LoRA checkpoint: its base (``base``, else where the checkpoint records it),
    checked against the recorded hash, with the checkpoint's adapters on it."""
    where = base if base is not None else recorded.path
    reason = changed_source(recorded, where)
    if reason:
        raise ValueError(
            f"{path} holds LoRA adapters only, trained on the base {recorded.path}, but {reason}: pass the base "
            f"they were trained on as GPTModule.from_pretrained({str(path)!r}, base=<that model's directory>)"
        )
    hparams = read_checkpoint_hparams(path)
    config = _config_with(hparams["config"], overrides)
    fields = {field.name: getattr(config, field.name) for field in dataclasses.fields(GPTConfig)}
    module = load_pretrained(  # the base, in the configuration the adapters were trained in
        cls,
        where,
        optimizer=optimizer or hparams.get("optimizer"),
        seed=seed if seed is not None else hparams.get("seed", 1234),
        strict=strict,
        **fields,
    )
    module.pretrained_source = LoadedWeights(where, sha256=recorded.sha256)  # hashed just above: it is the recorded
    _load_checkpoint_weights(module.model, path, config.vocab_size, strict, config, base_loaded=True)
    return module


def load_pretrained(
    cls: type,
    path: str | os.PathLike,
    optimizer: Optional[OptimizerConfig] = None,
    seed: Optional[int] = None,
    strict: bool = True,
    adapter: Optional[str | os.PathLike] = None,
    base: Optional[str | os.PathLike] = None,
    **overrides: Any,
):
    """``cls(config, optimizer, seed)`` with the weights of ``path`` (an HF Llama directory or one of our
    checkpoints) in a one-process model, in eval mode, with the PEFT LoRA adapter directory ``adapter`` on it. See
    :meth:`GPTModule.from_pretrained`. At a URL, our checkpoint's tensors are read from the store and a Hugging Face
    or adapter directory from a local copy (cached, :mod:`megatron_lite.core.object_staging`)."""
    if adapter is not None:
        adapter = local_directory(adapter, ADAPTER_CONFIG, "a PEFT adapter directory")
        read_peft_config(adapter)  # a directory that is no adapter ours can hold is refused before any weight is read
    given = path  # what the weights are recorded to come from (a LoRA run on them names it as its base)
    path = _readable(path)
    recorded = recorded_base(read_meta_plain(path)) if is_checkpoint_directory(path) else None
    if recorded is not None:
        if adapter is not None:
            raise ValueError(
                f"{path} is a LoRA run's checkpoint, which holds its adapters already: load it without adapter=, or "
                f"pass its base with the PEFT adapter instead"
            )
        return _load_adapted(cls, path, recorded, base, optimizer, seed, strict, overrides)
    if base is not None:
        raise ValueError(f"base= names the base of an adapter-only LoRA checkpoint; {path} is not one")
    interleaved = True  # an adapter on our checkpoint: PEFT's rows as `convert --to hf` writes the base's
    if is_checkpoint_directory(path):
        hparams = read_checkpoint_hparams(path)
        config = _config_with(hparams["config"], overrides)
        module = cls(
            config,
            optimizer or hparams.get("optimizer") or OptimizerConfig(),
            seed if seed is not None else hparams.get("seed", 1234),
        )
        module.model = module.build_model(ParallelLayout.single())
        _load_checkpoint_weights(module.model, path, config.vocab_size, strict, config)
    elif is_hf_directory(path):
        config, state = load_hf(path, **overrides)
        interleaved = interleaved_rope(read_hf_config(path), config)
        module = cls(config, optimizer or OptimizerConfig(), seed if seed is not None else 1234)
        module.model = module.build_model(ParallelLayout.single())
        params = dict(module.model.named_parameters())
        for name in _VOCAB_PARAMS:  # zero rows where the model pads the vocabulary
            if name in state:
                state[name] = fit_vocab_rows(state[name], params[name].tp_shard.global_shape[0])
        load_full_state(module.model, state, vocab_size=config.vocab_size, strict=strict)
    elif not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist; pass a local Hugging Face model directory or one of our "
            f"checkpoints (nothing is downloaded)"
        )
    else:
        raise FileNotFoundError(
            f"{path} is neither a Hugging Face model directory (config.json + safetensors) nor a "
            f"megatron-lite checkpoint (DCP .metadata)"
        )
    module.pretrained_source = LoadedWeights(given)  # a LoRA run on this base then saves only its adapters
    if adapter is not None:
        load_peft_adapter(module.model, adapter, module.config, module.seed, interleaved_rope=interleaved)
    module.model.eval()
    return module


def _readable(path: str | os.PathLike) -> Location:
    """Where ``load_pretrained`` reads ``path`` from: a local path itself; for a URL, the local copy of the Hugging
    Face directory there or the prefix of the files of our checkpoint there (read where they are)."""
    if not is_remote(path):
        return Path(path)
    url = str(location(path))
    return (
        local_directory(url, CONFIG, "a Hugging Face model directory")
        if is_hf_url(url)
        else resolve_remote_checkpoint(url)
    )


def tokenizer_metadata(tokenizer: Any) -> dict[str, Any]:
    """The checkpoint entries that make a checkpoint carry ``tokenizer``: the ``build_tokenizer`` arguments
    (:data:`~megatron_lite.tokenizers.build.TOKENIZER_KEY`) naming copies of its files inside the checkpoint, and
    those files (:data:`~megatron_lite.core.checkpoint.format.sharded.EMBEDDED_FILES`, copied by the save). ``{}`` for
    None or a tokenizer that is not one of ours. A file that is gone (a cleaned cache) never fails a save: the
    tokenizer is then recorded where its files were, with a warning."""
    record = portable_tokenizer_spec(tokenizer) if tokenizer is not None else None
    if record is None:
        return {}
    spec, files = record
    gone = [source for source in files.values() if not os.path.isfile(source)]
    if gone:
        warnings.warn(
            f"megatron-lite: the tokenizer file {gone[0]} is gone, so the checkpoint records the tokenizer "
            f"without a copy of its files",
            stacklevel=2,
        )
        return {TOKENIZER_KEY: tokenizer_spec(tokenizer)}
    return {TOKENIZER_KEY: spec, EMBEDDED_FILES: files}


def hf_side_directory(source: str | os.PathLike) -> Optional[Path]:
    """The HF files (tokenizer, generation config, config.json) that travel with the model at ``source``: an
    HF directory itself, or the ``hf/`` folder of one of our checkpoints; None when it has none."""
    source = Path(source)
    side = (
        source / CHECKPOINT_SIDE_DIR if is_checkpoint_directory(source) else source if is_hf_directory(source) else None
    )
    return side if side is not None and side.is_dir() else None


def save_weights_checkpoint(
    module,
    path: str | os.PathLike,
    hf_source: Optional[str | os.PathLike] = None,
    metadata: Optional[dict[str, Any]] = None,
    tokenizer: Any = None,
) -> Location:
    """Write ``module``'s one-process model as one of our checkpoints (weights and hyperparameters, no optimizer
    state). ``hf_source``: an HF directory the model came from; its tokenizer, generation config and
    config.json are kept in the checkpoint's ``hf/`` folder for a later export. ``tokenizer``: the model's
    tokenizer, recorded with copies of its files (:func:`tokenizer_metadata`). ``metadata``: more JSON entries
    for the checkpoint's meta.json. Everything is written atomically and covered by the manifest; at a URL through
    the object store's commit (:mod:`~megatron_lite.core.checkpoint.format.object_commit`)."""
    if module.model is None or getattr(module.model, "layout", ParallelLayout.single()).world_size != 1:
        raise ValueError("save_weights_checkpoint writes a one-process model (GPTModule.from_pretrained builds one)")
    path = location(path)
    carried = tokenizer_metadata(tokenizer)
    extra = {
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": lightning.__version__,
        "hyper_parameters": dict(module.hparams),
        "hparams_name": getattr(module, "_hparams_name", None),
        LAYOUT_RECORD: layout_record(ParallelLayout.single()),
        **carried,
        **(metadata or {}),
    }
    files = {**carried.get(EMBEDDED_FILES, {}), **(metadata or {}).get(EMBEDDED_FILES, {})}
    if hf_source is not None:
        files.update(
            {
                f"{CHECKPOINT_SIDE_DIR}/{name}": str(Path(hf_source) / name)
                for name in (*SIDE_FILES, CONFIG)
                if (Path(hf_source) / name).is_file()
            }
        )
    extra[EMBEDDED_FILES] = files
    with warnings.catch_warnings():  # DCP warns that it assumes one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # latest=False: a writer's output is no run's newest save (ckpt_path=<the folder it is in> must not load it)
        save_sharded({"model": sharded_model_state(module, ParallelLayout.single())}, path, extra=extra, latest=False)
    return path
