"""A bad expert layout is refused in the launching process, before any rank is forked, in one line naming the fix."""

import os
from pathlib import Path
from typing import Optional

import lightning as L
import pytest

import megatron_lite as ml
from megatron_lite.data import MockGPTDataModule

_MARKER: Optional[Path] = None


def _mark_forked_child() -> None:
    if _MARKER is not None:
        _MARKER.touch()


os.register_at_fork(after_in_child=_mark_forked_child)


@pytest.mark.parametrize(
    "devices, strategy, model, match",
    [
        (4, dict(expert_model_parallel_size=4), dict(num_moe_experts=6), r"num_moe_experts \(6\) must be divisible"),
        (2, dict(expert_model_parallel_size=4), {}, r"1 x 4 = 4 must divide the ranks of a pipeline stage"),
        (2, dict(tensor_model_parallel_size=2), {}, r"needs sequence_parallel=True"),
        (2, dict(expert_model_parallel_size=2), dict(num_moe_experts=None), r"this model has none"),
        (2, dict(expert_model_parallel_size=2, use_torch_fsdp2=True), {}, r"FSDP2"),
    ],
)
def test_bad_expert_layout_is_refused_before_launch(devices, strategy, model, match, tmp_path):
    global _MARKER
    _MARKER = tmp_path / "forked"
    config = ml.GPTConfig(
        **{
            **dict(
                num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, num_moe_experts=4
            ),
            **model,
        }
    )
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", **strategy),
        accelerator="cpu",
        devices=devices,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = MockGPTDataModule(seq_length=16, micro_batch_size=1, global_batch_size=devices, vocab_size=64)
    try:
        with pytest.raises(ValueError, match=match) as info:
            trainer.fit(ml.GPTModule(config), data)
    finally:
        _MARKER, marker = None, _MARKER
    assert not marker.exists(), "a rank was started before the layout was refused"
    assert "\n" not in str(info.value)
