"""Predictions handed back from forked ranks: each data-parallel replica writes its predictions with
their sample indices (safetensors), and the launching process merges them into what one process would
have returned: one row per sample, in the dataset's order, in batches of the loader's batch size."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from megatron_lite.core.checkpoint.format.safetensors_io import load_safetensors, save_safetensors
from megatron_lite.core.parallel.layout import ParallelLayout

PerLoader = list[tuple[list[Any], list[list[int]], Optional[int]]]


def write_predictions(per_loader: PerLoader, layout: ParallelLayout, path: str) -> None:
    """One replica's predictions as safetensors: ``<loader>.<batch>`` and ``<loader>.<batch>.index``."""
    tensors: dict[str, Tensor] = {}
    metadata = {"loaders": str(len(per_loader)), "dp_rank": str(layout.dp_rank), "dp_size": str(layout.dp_size)}
    for k, (predictions, indices, batch_size) in enumerate(per_loader):
        metadata[f"batch_size.{k}"] = str(batch_size or 0)
        for i, prediction in enumerate(predictions):
            index = indices[i] if i < len(indices) else None
            if (
                not isinstance(prediction, Tensor)
                or index is None
                or prediction.ndim == 0
                or prediction.shape[0] != len(index)
            ):
                metadata["not_tensors"] = (
                    type(prediction).__name__
                    if not isinstance(prediction, Tensor)
                    else f"a tensor of shape {tuple(prediction.shape)} for a batch of {len(index or [])} samples"
                )
                save_safetensors({}, path, metadata)
                return
            tensors[f"{k}.{i}"] = prediction
            tensors[f"{k}.{i}.index"] = torch.tensor(index, dtype=torch.int64)
    save_safetensors(tensors, path, metadata)


def merge_predictions(directory: str, rank_zero_result: Any) -> Any:
    """Every replica's predictions, one row per sample in the dataset's order, cut into batches of the
    loader's batch size: what one process would return. Without files (return_predictions=False),
    rank 0's result."""
    files = sorted(Path(directory).glob("rank*.safetensors")) if os.path.isdir(directory) else []
    if not files:
        return rank_zero_result
    pieces = [load_safetensors(f) for f in files]
    odd = next((m["not_tensors"] for _, m in pieces if "not_tensors" in m), None)
    if odd is not None:
        if len(pieces) == 1:
            return rank_zero_result  # one replica: rank 0's predictions are all of them, whatever their type
        raise TypeError(
            f"predict_step returned {odd}; with data parallelism the launching process merges the ranks' "
            f"predictions by sample, which needs a tensor whose first dimension is the batch. Return such a "
            f"tensor, or write predictions from the ranks with a lightning BasePredictionWriter callback and "
            f"trainer.predict(..., return_predictions=False)."
        )
    loaders = int(pieces[0][1]["loaders"])
    merged: list[list[Tensor]] = []
    for k in range(loaders):
        rows: dict[int, Tensor] = {}
        batch_size = max(int(m.get(f"batch_size.{k}", 0)) for _, m in pieces)
        for tensors, _ in pieces:
            i = 0
            while f"{k}.{i}" in tensors:
                batch, index = tensors[f"{k}.{i}"], tensors[f"{k}.{i}.index"].tolist()
                rows.update(zip(index, batch.unbind(0)))
                batch_size = batch_size or len(index)
                i += 1
        ordered = [rows[i] for i in sorted(rows)]
        merged.append([torch.stack(ordered[j : j + batch_size]) for j in range(0, len(ordered), max(batch_size, 1))])
    return merged[0] if loaders == 1 else merged
