"""DPO on packed preference rows (issue 16): several pairs per row of seq_length + 1 tokens, each sequence its
own document (cu_seqlens), equals DPO on one pair per row pair through a real Trainer (ranks forked).

The same 20 pairs form the global batch in both runs (the whole train split each step; batch sizes count
packed rows when packed), so the per-step losses, the first step's full gradients, the final parameters
(rtol 1e-5) and the logged rewards must agree: one process, DP2 (with the reference's log-probs
precomputed over packed rows), CP2 (packed rows on the context-parallel packed-attention path, each rank's
per-sequence partial sums all-reduced), PP2 (the sequence slots reach the last stage) and TP2 (vocab-parallel
cross entropy). Resume counts rows.
"""

import json
import random
from pathlib import Path

import lightning as L
import pytest
import torch
from parity_utils import Recorder, assert_same_training, tiny_config
from test_dpo_parity import RewardRecorder

import megatron_lite as ml
from megatron_lite.data import PreferenceDataModule
from megatron_lite.rl import DPOModule
from megatron_lite.tokenizers import NullTokenizer

STEPS = 2
PAIRS = 20
CONFIG = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=128,
    seq_length=64,
    make_vocab_size_divisible_by=32,
)


def write_short_pairs(path: Path, n: int, vocab: int, seed: int = 0) -> str:
    """Pairs of 2..15 tokens per sequence (prompt included), so that several fit one 65-token row."""
    rng = random.Random(seed)
    words = lambda k: " ".join(str(rng.randrange(vocab - 1)) for _ in range(k))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(n):
            f.write(
                json.dumps(
                    {
                        "prompt": words(rng.randint(1, 6)),
                        "chosen": words(rng.randint(0, 8)),
                        "rejected": words(rng.randint(0, 8)),
                    }
                )
                + "\n"
            )
    return str(path)


def datamodule(data_file: str, pack: bool, mbs: int = 0, gbs: int = 0) -> PreferenceDataModule:
    config = tiny_config(**CONFIG)
    data = PreferenceDataModule(
        data_file,
        NullTokenizer(config.vocab_size),
        seq_length=config.seq_length,
        micro_batch_size=1,
        global_batch_size=1,
        split="100,0",
        seed=3,
        pack_sequences=pack,
    )
    data.setup()
    rows = len(data.datasets["train"])  # the whole split is the global batch: the same pairs in both runs
    return PreferenceDataModule(
        data_file,
        NullTokenizer(config.vocab_size),
        seq_length=config.seq_length,
        micro_batch_size=mbs or rows // 2,
        global_batch_size=gbs or rows,
        split="100,0",
        seed=3,
        pack_sequences=pack,
    )


def train(
    out: Path,
    data_file: str,
    *,
    pack: bool,
    devices=1,
    tp=1,
    cp=1,
    pp=1,
    precompute=False,
    mbs=0,
    gbs=0,
    steps=STEPS,
    callbacks=(),
    ckpt_path=None,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    optimizer = ml.OptimizerConfig(optimizer="sgd", lr=0.3, lr_decay_style="constant", clip_grad=0.0)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
            pipeline_model_parallel_size=pp,
            start_method="fork",
        ),
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Recorder(out), RewardRecorder(out), *callbacks],
    )
    trainer.fit(
        DPOModule(
            tiny_config(**CONFIG),
            optimizer=optimizer,
            seed=1234,
            beta=0.5,
            label_smoothing=0.1,
            precompute_reference_log_probs=precompute,
        ),
        datamodule(data_file, pack, mbs, gbs),
        ckpt_path=ckpt_path,
    )
    result = torch.load(out / "result.pt", weights_only=False)
    result["rewards"] = [torch.load(out / f"rewards_{r}.pt") for r in range(devices)]
    return result


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_short_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", PAIRS, CONFIG["vocab_size"])


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory, data_file):
    return train(tmp_path_factory.mktemp("unpacked"), data_file, pack=False)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("one_process", dict()),
        ("dp2_precomputed", dict(devices=2, precompute=True)),
        ("cp2", dict(devices=2, cp=2)),
        ("pp2", dict(devices=2, pp=2)),
        ("tp2", dict(devices=2, tp=2)),
    ],
)
def test_packed_rows_train_like_one_pair_per_row(name, kwargs, unpacked, data_file, tmp_path):
    packed = datamodule(data_file, True)
    packed.setup()
    rows = packed.datasets["train"]
    assert len(rows) < PAIRS / 2  # several pairs per row
    result = train(tmp_path, data_file, pack=True, **kwargs)
    assert result["global_step"] == STEPS
    assert unpacked["losses"][0] == pytest.approx(0.6931471805599453, rel=1e-6)  # policy == reference at step 0
    assert unpacked["losses"][1] != unpacked["losses"][0]
    assert_same_training(result, unpacked)
    expected = torch.tensor(unpacked["rewards"][0])
    for rank_values in result["rewards"]:
        torch.testing.assert_close(torch.tensor(rank_values), expected, rtol=1e-5, atol=1e-5)


def test_packed_resume_is_exact(data_file, tmp_path):
    """Consumed samples count packed rows: saved after step 2 (of 2-row global batches) and resumed, steps 3-4
    see the same rows, with the same losses, as the uninterrupted run's."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    kwargs = dict(pack=True, mbs=1, gbs=2, steps=4)
    full = train(
        tmp_path / "full",
        data_file,
        **kwargs,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1)],
    )
    checkpoint = next(p for p in (tmp_path / "ckpts").iterdir() if "step=2" in p.name)
    resumed = train(tmp_path / "resumed", data_file, **kwargs, ckpt_path=str(checkpoint))
    assert len(set(full["losses"])) == 4 and len(resumed["losses"]) == 2
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][2:]), rtol=1e-6, atol=0)
