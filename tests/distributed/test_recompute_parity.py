"""Activation recomputation under TP2 + sequence parallel through a real Trainer trains exactly like
no recompute: same per-step losses and first-step gradients, with dropout on (each TP rank's
model-parallel stream and the SP all-gathers inside recomputed layers are replayed)."""

from pathlib import Path

import lightning as L
import pytest
import torch
from parity_utils import assert_same_training, run, tiny_config

DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
RECOMPUTES = {
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}
# Which of (layer 0, layer 1, core attention of layer 0) each setting runs twice per microbatch.
RUN_TWICE = {"full_uniform": (True, True, True), "full_block": (True, False, True), "selective": (False, False, True)}
STEPS = 5


class ForwardEntries(L.Callback):
    """Counts forward entries of two layers and a core attention during training (rank 0), so the
    test knows the Trainer path really recomputed (a pre-hook also fires in the recompute)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.counts = {"layer0": 0, "layer1": 0, "core0": 0}

    def on_train_start(self, trainer, pl_module):
        layers = pl_module.model.layers
        modules = {"layer0": layers["0"], "layer1": layers["1"], "core0": layers["0"].self_attention.core_attention}
        for name, module in modules.items():
            module.register_forward_pre_hook(lambda *_, n=name: self.counts.__setitem__(n, self.counts[n] + 1))

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            torch.save(self.counts, self.out / "entries.pt")


def train(out: Path, **recompute) -> tuple[dict, dict]:
    result = run(
        out,
        devices=2,
        tp=2,
        sp=True,
        steps=STEPS,
        config=tiny_config(**DROPOUT, **recompute),
        callbacks=[ForwardEntries(out)],
    )
    return result, torch.load(Path(out) / "entries.pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("name", list(RECOMPUTES))
def test_recompute_under_tp2_sp_matches_no_recompute(name, reference, tmp_path):
    (expected, plain_entries), (result, entries) = reference, train(tmp_path, **RECOMPUTES[name])
    assert result["global_step"] == STEPS and len(result["losses"]) == STEPS
    assert_same_training(result, expected, rtol=1e-6)
    assert plain_entries["layer0"] > 0
    for module, twice in zip(("layer0", "layer1", "core0"), RUN_TWICE[name]):
        assert entries[module] == plain_entries[module] * (2 if twice else 1), (name, entries, plain_entries)
