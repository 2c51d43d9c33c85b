"""A checkpoint loads only into the model it was saved from (issue 21, item 1), unless asked otherwise.

fit/validate/test/predict(ckpt_path=...) and ``from_pretrained`` refuse a checkpoint whose model entries differ
from the module's -- a 4-layer checkpoint into 2 layers, a trained output layer into a model that ties it to the
embedding -- naming a few entries, counting the rest and saying which config fields differ. Where the checkpoint's
metadata tells (the module's model built for one process on the meta device), before any rank starts; where only
the ranks can (an objective extension's sub-modules), on every rank together. ``module.strict_loading = False``
(``from_pretrained(strict=False)``) loads the entries both have, on purpose. A checkpoint of weights alone is no
resume point for ``fit`` (item 14a): refused before launch, naming ``from_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest

import megatron_lite as ml
from megatron_lite.callbacks import TrainDraftHead
from megatron_lite.data import MockGPTDataModule
from megatron_lite.pretrained import save_weights_checkpoint

CONFIG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16)


def _module(**changes) -> ml.GPTModule:
    optimizer = ml.OptimizerConfig(lr=2e-2, lr_warmup_iters=0, lr_decay_style="constant")
    return ml.GPTModule(ml.GPTConfig(**{**CONFIG, **changes}), optimizer, seed=1)


def _data() -> MockGPTDataModule:
    return MockGPTDataModule(
        seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=128, seed=3, num_val_samples=8
    )


def _trainer(devices: int = 1, **kwargs) -> L.Trainer:
    return L.Trainer(
        strategy="megatron_fork",
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


class Started(L.Callback):
    """Leaves a file behind when a rank sets up: whether anything was launched."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def setup(self, trainer, pl_module, stage) -> None:
        self.path.touch()


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    """A trained 4-layer checkpoint with its own output layer."""
    path = tmp_path_factory.mktemp("four_layers") / "ckpt"
    module = _module()
    trainer = _trainer(max_steps=6, limit_val_batches=0)
    trainer.fit(module, _data())
    with pytest.warns(UserWarning, match="no optimizer state"):
        trainer.save_checkpoint(path)
    return path


@pytest.mark.parametrize(
    "change,entries,differ",
    [
        (
            dict(num_layers=2),
            r"unexpected 12 entries \(model\.layers\.2\.input_layernorm\.weight, .* and 7 more\)",
            r"num_layers=4 \(this module's: 2\)",
        ),
        (
            dict(share_embeddings_and_output_weights=True),
            r"unexpected 1 entry \(model\.output_layer\.weight\)",
            r"share_embeddings_and_output_weights=False \(this module's: True\)",
        ),
    ],
    ids=["fewer_layers", "tied_output_layer"],
)
def test_a_checkpoint_of_another_model_is_refused_before_any_rank_starts(
    change, entries, differ, four_layers, tmp_path
):
    started = tmp_path / "started"
    for call in ("fit", "validate", "test", "predict"):
        trainer = _trainer(
            max_steps=1,
            limit_val_batches=1,
            limit_test_batches=1,
            limit_predict_batches=1,
            callbacks=[Started(started)],
        )
        with pytest.raises(ValueError, match=f"does not fit GPTModule's model: {entries}") as error:
            getattr(trainer, call)(_module(**change), _data(), ckpt_path=str(four_layers))
        assert not started.exists(), f"{call} started a rank"
    error.match(differ)  # the config fields that differ, from the checkpoint's saved hyperparameters
    assert "strict_loading = False" in str(error.value) and len(str(error.value)) < 1000
    bare = entries.replace("model\\.", "")  # from_pretrained names the model's own entries
    with pytest.raises(ValueError, match=f"{bare}; it was saved from a model with {differ}.*strict=False"):
        ml.GPTModule.from_pretrained(four_layers, **change)


def test_strict_loading_false_loads_the_entries_both_have(four_layers):
    """Asked for explicitly, the shared entries load (layers 0-1, embedding, output layer) and the rest is left
    out: the same model as from_pretrained(strict=False) gives, not a fresh one."""
    partial = _module(num_layers=2)
    partial.strict_loading = False
    loss = _trainer(limit_val_batches=2).validate(partial, _data(), ckpt_path=str(four_layers), verbose=False)[0][
        "val/loss"
    ]
    pretrained = ml.GPTModule.from_pretrained(four_layers, num_layers=2, strict=False)
    assert loss == pytest.approx(
        _trainer(limit_val_batches=2).validate(pretrained, _data(), verbose=False)[0]["val/loss"], rel=1e-6
    )
    fresh = _trainer(limit_val_batches=2).validate(_module(num_layers=2), _data(), verbose=False)[0]["val/loss"]
    assert abs(fresh - loss) > 0.05


def test_what_only_the_ranks_can_check_is_refused_on_every_rank_together(tmp_path):
    """A TrainDraftHead run's checkpoint holds the draft head (``model.draft_head.*``), a sub-module only the
    extension adds in the ranks: validated without TrainDraftHead at DP2, both ranks refuse it with the same
    message (no hang) instead of dropping it; with the callback it loads."""
    checkpoint, started = tmp_path / "draft.ckpt", tmp_path / "started"
    trainer = _trainer(max_steps=1, limit_val_batches=0, callbacks=[TrainDraftHead()])
    trainer.fit(_module(), _data())
    with pytest.warns(UserWarning, match="no optimizer state"):
        trainer.save_checkpoint(checkpoint)
    with pytest.raises(ValueError, match=r"unexpected 9 entries \(model\.draft_head\.base_config_digest, "):
        _trainer(2, limit_val_batches=1, callbacks=[Started(started)]).validate(
            _module(), _data(), ckpt_path=str(checkpoint)
        )
    assert started.exists()  # the launching process could not tell a head from what an extension adds
    _trainer(2, limit_val_batches=1, callbacks=[TrainDraftHead()]).validate(
        _module(), _data(), ckpt_path=str(checkpoint)
    )


def test_fit_refuses_a_weights_only_checkpoint_before_launch(four_layers, tmp_path):
    """What `megatron-lite convert --from hf` writes holds no optimizer, schedule or loop state: resuming it used to
    fail inside the ranks with Lightning's KeyError about save_weights_only."""
    weights = save_weights_checkpoint(ml.GPTModule.from_pretrained(four_layers), tmp_path / "weights")
    started = tmp_path / "started"
    with pytest.raises(ValueError, match=r"holds weights only .* GPTModule\.from_pretrained\("):
        _trainer(max_steps=1, callbacks=[Started(started)]).fit(_module(), _data(), ckpt_path=str(weights))
    assert not started.exists()
