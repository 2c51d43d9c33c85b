"""Hugging Face Llama directories: read one into our config and full state, write one from them.

Only safetensors are read (a single ``model.safetensors`` or shards listed in ``model.safetensors.index.json``;
bf16, fp16 or fp32, or block-scaled FP8 dequantized per shard: :mod:`~megatron_lite.core.checkpoint.hf.fp8_blocks`),
with our own torch-only reader: a pickle (``pytorch_model.bin``) is never opened, nor a shard the index names
outside the directory. The config is mapped by :mod:`~megatron_lite.core.checkpoint.hf.config`
(unsupported architectures and options refused by name), the tensors by
:mod:`~megatron_lite.core.checkpoint.hf.weights`; every shape is checked against the config from the files' headers
before any tensor is read. Where config.json and the files disagree on tied embeddings, the files win, as in
transformers (:func:`_tie_rule`).

Writing goes to a temporary sibling directory renamed into place at the end, so a failed export never
leaves a half-written model under the output name. The tokenizer and generation config travel beside the
weights (:func:`copy_side_files`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping, Optional

import torch

from megatron_lite.core.checkpoint.format.safe_reader import is_file_name
from megatron_lite.core.checkpoint.format.safetensors_io import (
    load_safetensors,
    read_safetensors_header,
    save_safetensors,
)
from megatron_lite.core.checkpoint.hf.config import gpt_config_from_hf, hf_config_from_gpt
from megatron_lite.core.checkpoint.hf.fp8_blocks import SCALE_SUFFIX, dequantize_shard, dequantized_shapes, fp8_blocks
from megatron_lite.core.checkpoint.hf.weights import check_hf_shapes, hf_to_state, state_to_hf
from megatron_lite.core.models.config import GPTConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# What a model directory carries besides its weights and config: the tokenizer in any of HF's formats, the
# chat template and the generation defaults (token ids, sampling settings).
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
# Inside one of our checkpoints: the HF files a converted model came with (tokenizer, generation config, and
# its original config.json, whose token ids and model type an export writes back).
CHECKPOINT_SIDE_DIR = "hf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' long-standing default shard size
HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"

log = logging.getLogger(__name__)


def is_hf_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like an HF model directory (a ``config.json``, not one of our DCP checkpoints)."""
    path = Path(path)
    return (path / CONFIG).is_file() and not (path / ".metadata").is_file()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); fix or replace the file") from None
    except RecursionError:
        raise ValueError(f"{path} is malformed: it nests deeper than Python reads; fix or replace the file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of an HF model directory, as a dict."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory} is not a Hugging Face model directory (no {CONFIG}); pass the "
            f"directory that save_pretrained() or a hub download wrote"
        )
    return _read_json(path)


def _weight_files(directory: Path) -> dict[str, Path]:
    """{tensor name: file holding it}."""
    index = directory / INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map; the index is damaged")
        outside = [file for file in weight_map.values() if not is_file_name(file)]
        if outside:
            raise ValueError(
                f"{index} names the shard {outside[0]!r}, which is not a file name inside the model "
                f"directory: a model's shards lie beside its index, and no other file is read (the index "
                f"is damaged or crafted)"
            )
        files = {name: directory / file for name, file in weight_map.items()}
        absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if absent:
            raise FileNotFoundError(f"{index} lists {absent} but they are not in {directory}; copy every shard")
        return files
    single = directory / WEIGHTS
    if single.is_file():
        names, _ = read_safetensors_header(single)
        return {name: single for name in names}
    pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
    hint = (
        (
            f" It holds {pickles[:3]}: pickled weights are never loaded (they can run code); save the model with "
            f"save_pretrained(..., safe_serialization=True) or convert it to safetensors first."
        )
        if pickles
        else ""
    )
    raise FileNotFoundError(f"no {WEIGHTS} or {INDEX} in {directory}; only safetensors weights are read.{hint}")


def read_hf_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of an HF directory's weights as they are read, from the safetensors headers alone: the
    scales of block-scaled FP8 weights are checked against their weights and left out."""
    files = _weight_files(Path(directory))
    entries: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in sorted(set(files.values())):
        names, _ = read_safetensors_header(path)
        entries.update({name: entry for name, entry in names.items() if files.get(name) == path})
    return dequantized_shapes(entries, fp8_blocks(read_hf_config(directory)), str(directory))


def _read_by_file(files: Mapping[str, Path], names: Optional[Collection[str]]) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of ``names`` (all if None) that ``files`` ({name: file}) place, one file's at a time."""
    by_file: dict[Path, set[str]] = {}
    for name in files if names is None else names:  # (a hub model has ~100k tensors: no scan per file)
        if name in files:
            by_file.setdefault(files[name], set()).add(name)
    for path in sorted(by_file):
        yield load_safetensors(path, by_file[path])[0]


def read_hf_tensors(directory: str | os.PathLike, names: Optional[Collection[str]] = None) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's weights (in their saved dtype), or those of ``names`` it has; block-scaled
    FP8 weights are dequantized one shard at a time, to the dtype of config.json (bfloat16 if it names none), and
    their scales are not returned."""
    files = _weight_files(Path(directory))
    hf_config = read_hf_config(directory)
    blocks = fp8_blocks(hf_config)
    if blocks is None:
        return {name: t for shard in _read_by_file(files, names) for name, t in shard.items()}
    dtype = DTYPES.get(str(hf_config.get("dtype") or hf_config.get("torch_dtype")), torch.bfloat16)

    def read_scales(scales: Collection[str]) -> dict[str, torch.Tensor]:
        return {name: t for shard in _read_by_file(files, scales) for name, t in shard.items()}

    weights = [name for name in files if not name.endswith(SCALE_SUFFIX) and (names is None or name in names)]
    tensors: dict[str, torch.Tensor] = {}
    for shard in _read_by_file(files, weights):
        tensors.update(dequantize_shard(shard, read_scales, blocks, dtype))
    return tensors


def _tie_rule(
    config: GPTConfig,
    directory: str | os.PathLike,
    overrides: dict[str, Any],
    tensors: Optional[dict[str, torch.Tensor]] = None,
) -> GPTConfig:
    """``config`` untied when its config.json ties the output layer to the embedding but the files hold an
    ``lm_head.weight`` that is not the embedding: the files win, as in transformers (5.x; 4.x tied them silently).
    An ``lm_head.weight`` equal to the embedding is a copy and stays tied. ``tensors``: the directory's, if read."""
    if not config.share_embeddings_and_output_weights or "share_embeddings_and_output_weights" in overrides:
        return config
    if tensors is None:
        tensors = read_hf_tensors(directory, (HEAD, EMBEDDING))
    head, embedding = tensors.get(HEAD), tensors.get(EMBEDDING)
    if head is None or embedding is None:
        return config  # a missing embedding is named by the shape check
    if head.shape == embedding.shape and torch.equal(head, embedding.to(head.dtype)):
        return config  # a copy of the embedding
    log.warning(
        "megatron-lite: %s sets tie_word_embeddings=true, but %s holds an lm_head.weight that is not the "
        "embedding: loading the two untied, as transformers does. Set tie_word_embeddings to false in "
        "config.json to silence this, or remove lm_head.weight to tie them.",
        Path(directory) / CONFIG,
        directory,
    )
    return dataclasses.replace(config, share_embeddings_and_output_weights=False)


def _mtp_rule(config: GPTConfig, shapes: Mapping[str, tuple[int, ...]], overrides: dict[str, Any]) -> GPTConfig:
    """``config`` without multi-token prediction when its config.json counts MTP layers
    (``num_nextn_predict_layers``) that the files do not hold: transformers writes the count but never the layers
    (it has none), DeepSeek's own checkpoints hold them."""
    if not config.mtp_num_layers or "mtp_num_layers" in overrides:
        return config
    if f"model.layers.{config.num_layers}.eh_proj.weight" in shapes:
        return config
    return dataclasses.replace(config, mtp_num_layers=None)


def read_hf_model_config(directory: str | os.PathLike, **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` that :func:`load_hf` gives an HF directory, reading no weights but the output layer
    and the embedding of a tied config (see :func:`_tie_rule`)."""
    config = _mtp_rule(gpt_config_from_hf(read_hf_config(directory), **overrides), read_hf_shapes(directory), overrides)
    return _tie_rule(config, directory, overrides)


def load_hf(directory: str | os.PathLike, **overrides: Any) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """(config, full state) of an HF Llama directory: GPTModel names, exactly ``vocab_size`` vocabulary rows,
    the saved dtype. ``overrides`` replace GPTConfig fields (a field that changes a shape is caught here)."""
    hf_config = read_hf_config(directory)
    shapes = read_hf_shapes(directory)
    config = _mtp_rule(gpt_config_from_hf(hf_config, **overrides), shapes, overrides)
    check_hf_shapes(shapes, config)  # every shape, before any tensor is read
    tensors = read_hf_tensors(directory)
    untied = _tie_rule(config, directory, overrides, tensors)
    if untied is not config:
        check_hf_shapes(shapes, untied)  # lm_head.weight's shape, now that it is read
    return untied, hf_to_state(tensors, untied, interleaved_rope=interleaved_rope(hf_config, config))


def interleaved_rope(hf_config: dict[str, Any], config: GPTConfig) -> bool:
    """Whether the HF weights of ``hf_config`` rotate interleaved channel pairs, whose rows (the base's and a PEFT
    adapter's ``lora_B``) are permuted on import: a DeepSeek-V3's unless ``rope_interleave`` is false."""
    return bool(config.multi_latent_attention) and hf_config.get("rope_interleave", True) is not False


def copy_side_files(source: str | os.PathLike, target: str | os.PathLike) -> list[str]:
    """Copy the tokenizer and generation-config files (:data:`SIDE_FILES`) that ``source`` has into ``target``;
    returns their names."""
    source, target = Path(source), Path(target)
    copied = []
    for name in SIDE_FILES:
        if (source / name).is_file():
            target.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, target / name)
            copied.append(name)
    return copied


def refuse_existing(path: str | os.PathLike, overwrite: bool) -> None:
    """Raise FileExistsError for an existing non-empty ``path`` unless ``overwrite``."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not overwrite:
        raise FileExistsError(f"{path} already exists and is not empty; pass a new output directory or overwrite it")


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """A temporary sibling of ``path`` to fill; renamed to ``path`` when the block succeeds, removed if it fails.
    An existing non-empty ``path`` is refused unless ``overwrite``."""
    path = Path(path)
    refuse_existing(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        path.rename(old)
    tmp.rename(path)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into files of at most ``max_bytes`` (a larger tensor gets a file of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(directory: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    """``tensors`` as ``model.safetensors``, or as files of at most ``max_shard_bytes`` listed in
    ``model.safetensors.index.json``, in ``directory``."""
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_safetensors(tensors, directory / WEIGHTS, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors({n: tensors[n] for n in names}, directory / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(directory / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})


def save_hf(
    directory: str | os.PathLike,
    config: GPTConfig,
    state: dict[str, torch.Tensor],
    *,
    dtype: str = "float32",
    source_config: Optional[dict[str, Any]] = None,
    side_files_from: Optional[str | os.PathLike] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write ``state`` (our full state, any vocabulary padding) as an HF model directory: ``config.json``,
    ``model.safetensors`` (or shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``), and the
    tokenizer / generation config files found in ``side_files_from``. ``source_config`` (the config.json the
    model came from) keeps its token ids and model type."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    hf_config = hf_config_from_gpt(config, dtype, source_config)
    tensors = {name: t.detach().to("cpu", DTYPES[dtype]).contiguous() for name, t in state_to_hf(state, config).items()}
    with atomic_directory(directory, overwrite) as tmp:
        write_weights(tmp, tensors, max_shard_bytes)
        if side_files_from is not None:
            copy_side_files(side_files_from, tmp)
        _write_json(tmp / CONFIG, hf_config)
    return Path(directory)
