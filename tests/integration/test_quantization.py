"""Quantization of a model trained on the bundled corpus (a module-scoped fit of a tiny model): PTQ through
``ml.post_training.quantize`` (INT8 SmoothQuant within 2% of the unquantized perplexity, FP8 within 5%, INT4-AWQ
reported, an FP8 KV cache within 5% with its greedy agreement reported), the ``Quantize`` callback at the end
of a fit writing a quantized checkpoint that ``from_pretrained`` and ``trainer.fit(ckpt_path=...)`` load back as
the same quantized model, QAT through ``Quantize(when="fit_start")`` recovering at least half of the INT4 gap of
a converged model (against the same fine-tune unquantized, then PTQ), and ``megatron-lite quantize``."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import lightning as L
import pytest
import torch

pytest.importorskip("modelopt.torch.quantization")

import megatron_lite as ml  # noqa: E402
from megatron_lite import cli  # noqa: E402
from megatron_lite.callbacks import Quantize  # noqa: E402
from megatron_lite.data import TextCorpusDataModule  # noqa: E402
from megatron_lite.post_training import perplexity, quantization_recipe, quantize  # noqa: E402
from megatron_lite.pretrained import save_weights_checkpoint  # noqa: E402

CONFIG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=384,
    seq_length=32,
    make_vocab_size_divisible_by=64,
    ffn_hidden_size=256,
)
TRAIN_STEPS = 80


def _data(root: Path) -> TextCorpusDataModule:
    return TextCorpusDataModule(
        "shakespeare",
        seq_length=32,
        micro_batch_size=8,
        global_batch_size=8,
        vocab_size=384,
        cache_dir=str(root / "cache"),
    )


def _trainer(steps: int, callbacks=(), **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=list(callbacks),
        **kwargs,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint of a tiny model trained on the bundled corpus, datamodule, calibration and held-out batches)."""
    root = tmp_path_factory.mktemp("quantization")
    torch.manual_seed(0)
    module = ml.GPTModule(ml.GPTConfig(**CONFIG), ml.OptimizerConfig(lr=1e-2, lr_warmup_iters=5, min_lr=1e-3))
    data = _data(root)
    _trainer(TRAIN_STEPS).fit(module, data)
    save_weights_checkpoint(module, root / "trained")
    calibration = list(itertools.islice(iter(data.train_dataloader()), 2))
    held_out = list(itertools.islice(iter(data.val_dataloader()), 4))
    return root / "trained", data, calibration, held_out


FINE_TUNE = ml.OptimizerConfig(lr=2e-3, lr_decay_style="constant")


def _load(path) -> ml.GPTModule:
    return ml.GPTModule.from_pretrained(path, optimizer=FINE_TUNE)


def test_ptq_perplexity_of_each_format(trained):
    path, _, calibration, held_out = trained
    base = perplexity(_load(path), held_out)
    ratios = {}
    for config in ("INT8_SMOOTHQUANT_CFG", "FP8_DEFAULT_CFG", "INT4_AWQ_CFG"):
        ratios[config] = perplexity(quantize(_load(path), config, calibration), held_out) / base
    kv = quantize(_load(path), None, calibration, kv_cache="FP8_KV_CFG")
    ratios["FP8_KV_CFG"] = perplexity(kv, held_out) / base
    prompts = [row[:8].tolist() for row in held_out[0]["tokens"][:4]]
    plain, cached = _load(path).generate(prompts, 16).tokens, kv.generate(prompts, 16).tokens
    agreement = sum(a == b for p, q in zip(plain, cached) for a, b in zip(p, q)) / sum(map(len, plain))
    print(
        f"\nunquantized perplexity {base:.3f}; quantized / unquantized: "
        + ", ".join(f"{k} {v:.4f}" for k, v in ratios.items())
        + f"; FP8 KV-cache greedy agreement {agreement:.3f}"
    )
    assert ratios["INT8_SMOOTHQUANT_CFG"] < 1.02
    assert ratios["FP8_DEFAULT_CFG"] < 1.05
    assert ratios["FP8_KV_CFG"] < 1.05


def test_quantize_callback_checkpoint_loads_back_as_the_same_quantized_model(trained, tmp_path):
    path, data, _, held_out = trained
    module = _load(path)
    callback = Quantize("INT8_SMOOTHQUANT_CFG", calib_batches=2, eval_batches=2)
    trainer = _trainer(1, [callback], strategy="megatron")
    trainer.fit(module, data)
    assert quantization_recipe(module.model)["config"] == "INT8_SMOOTHQUANT_CFG"
    assert set(callback.metrics) == {"val_ppl_before", "val_ppl_after", "val_ppl_ratio"}
    assert callback.metrics["val_ppl_ratio"] < 1.02
    trainer.save_checkpoint(tmp_path / "int8")
    probe = held_out[0]["tokens"][:, :-1]
    expected = module.full_logits(probe)
    # GPTModule.from_pretrained: the recipe and the quantizer tensors restored, no calibration
    loaded = _load(tmp_path / "int8")
    assert quantization_recipe(loaded.model) == quantization_recipe(module.model)
    torch.testing.assert_close(loaded.full_logits(probe), expected, rtol=0, atol=0)
    # trainer.fit(ckpt_path=...) without the callback would drop the quantizers: refused, naming the fix
    with pytest.raises(
        ValueError,
        match=r"holds a quantized model, but the module's model is not quantized.*"
        r"Quantize\(<its config>, when='fit_start'\)",
    ):
        _trainer(1, strategy="megatron").fit(
            ml.GPTModule(ml.GPTConfig(**CONFIG), FINE_TUNE), data, ckpt_path=str(tmp_path / "int8")
        )
    # trainer.fit(ckpt_path=...): Quantize(when="fit_start") rebuilds the quantizers before the checkpoint is read
    resumed = ml.GPTModule(ml.GPTConfig(**CONFIG), FINE_TUNE)
    _trainer(1, [Quantize("INT8_SMOOTHQUANT_CFG", when="fit_start", eval_batches=0)], strategy="megatron").fit(
        resumed, data, ckpt_path=str(tmp_path / "int8")
    )
    torch.testing.assert_close(resumed.full_logits(probe), expected, rtol=0, atol=0)


class _FixedSamples(L.LightningDataModule):
    """The same few batches for training, calibration and evaluation: a small fixed data set a tiny model can be
    trained to convergence on in seconds."""

    def __init__(self, batches: list[dict]) -> None:
        super().__init__()
        self.batches, self.vocab_size = batches, CONFIG["vocab_size"]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)


QAT_SAMPLES, QAT_BATCH, QAT_TRAIN_STEPS, QAT_STEPS = 96, 16, 300, 20
QAT_FINE_TUNE = ml.OptimizerConfig(lr=3e-4, lr_decay_style="constant", weight_decay=0.0)


def test_qat_recovers_at_least_half_of_the_int4_gap(tmp_path):
    """Issue 15's bound, with the fine-tuning confound removed. A tiny model trained to convergence on 96 fixed
    samples of the bundled corpus (300 steps, cosine decay to lr 0; perplexity measured on those samples) is
    precise enough that INT4-AWQ PTQ costs it a real gap (~10%), where the model of the other tests (far from
    converged, held-out) shows none. ``QAT_STEPS`` steps of QAT (``Quantize(when="fit_start")``, small constant
    lr) recover at least half of the gap; the same steps trained unquantized and then quantized (PTQ) recover
    less than half (the extra training lowers the unquantized perplexity a little, the quantization noise stays):
    QAT, not more training, closes it. Held-out perplexity is not the measure here: the model memorises."""
    source = TextCorpusDataModule(
        "shakespeare",
        seq_length=32,
        micro_batch_size=QAT_BATCH,
        global_batch_size=QAT_BATCH,
        vocab_size=384,
        cache_dir=str(tmp_path / "cache"),
    )
    source.prepare_data()
    source.setup("fit")
    data = _FixedSamples(list(itertools.islice(iter(source.train_dataloader()), QAT_SAMPLES // QAT_BATCH)))
    batches = data.batches
    torch.manual_seed(0)
    module = ml.GPTModule(
        ml.GPTConfig(**CONFIG),
        ml.OptimizerConfig(lr=1e-2, min_lr=0.0, weight_decay=0.0, lr_decay_iters=QAT_TRAIN_STEPS),
    )
    _trainer(QAT_TRAIN_STEPS).fit(module, data)
    save_weights_checkpoint(module, tmp_path / "converged")

    def load():
        return ml.GPTModule.from_pretrained(tmp_path / "converged", optimizer=QAT_FINE_TUNE)

    base = perplexity(load(), batches)
    ptq = perplexity(quantize(load(), "INT4_AWQ_CFG", batches[:2]), batches)
    fp = load()  # the confound: the same fine-tune unquantized, then PTQ
    _trainer(QAT_STEPS).fit(fp, data)
    fp_ppl = perplexity(fp, batches)
    fp_ptq = perplexity(quantize(fp, "INT4_AWQ_CFG", batches[:2]), batches)
    qat = load()
    weight = qat.model.layers["0"].mlp.linear_fc1.weight.detach().clone()
    callback = Quantize("INT4_AWQ_CFG", calib_batches=2, when="fit_start", eval_batches=len(batches))
    _trainer(QAT_STEPS, [callback]).fit(qat, data)
    assert quantization_recipe(qat.model)["config"] == "INT4_AWQ_CFG"
    assert not torch.equal(qat.model.layers["0"].mlp.linear_fc1.weight, weight)  # gradients reached the weights
    after = perplexity(qat, batches)
    assert callback.metrics["val_ppl_after_qat"] == pytest.approx(after, rel=1e-6)
    gap = ptq - base
    print(
        f"\nconverged model perplexity {base:.3f}, INT4-AWQ PTQ {ptq:.3f} (gap {gap:.3f}); after {QAT_STEPS} more "
        f"steps: unquantized {fp_ppl:.3f}, its PTQ {fp_ptq:.3f} (recovers {(ptq - fp_ptq) / gap:.2f} of the gap), "
        f"QAT {after:.3f} (recovers {(ptq - after) / gap:.2f})"
    )
    assert gap > 0.02 * base  # a real INT4 gap: four times the +-0.5% of the model above (measured ~10%)
    assert ptq - after >= 0.5 * gap  # QAT recovers at least half of it
    assert ptq - fp_ptq < 0.5 * gap  # more unquantized training does not
    assert after < fp_ptq


def test_quantize_cli_writes_a_quantized_checkpoint(trained, tmp_path, capsys):
    from megatron_lite.tokenizers.build import tokenizer_spec

    path, data, _, held_out = trained
    spec = tokenizer_spec(data.tokenizer)
    tokenizer_args = ["--tokenizer-type", spec["tokenizer_type"], "--tokenizer-model", spec["tokenizer_model"]]
    args = [
        "quantize",
        "--ckpt",
        str(path),
        "--config",
        "FP8_DEFAULT_CFG",
        "--data",
        "shakespeare",
        "--output",
        str(tmp_path / "fp8"),
        "--calib-batches",
        "1",
        "--eval-batches",
        "2",
        "--json",
        *tokenizer_args,
    ]
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    assert exit_.value.code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["config"] == "FP8_DEFAULT_CFG" and result["ratio"] < 1.05
    loaded = _load(tmp_path / "fp8")
    assert quantization_recipe(loaded.model)["config"] == "FP8_DEFAULT_CFG"
    assert perplexity(loaded, held_out) / perplexity(_load(path), held_out) < 1.05
    # a bad config name: one line listing the valid ones, exit code 2, nothing written
    with pytest.raises(SystemExit) as exit_:
        cli.main([*args[:4], "INT3_CFG", *args[5:8], str(tmp_path / "bad"), *args[9:]])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "unknown quantization config 'INT3_CFG'" in err and "INT8_SMOOTHQUANT_CFG" in err
    assert not (tmp_path / "bad").exists()


def test_ptq_at_the_end_of_a_forked_tp2_fit_hands_back_the_quantized_model():
    """Quantize(when="fit_end") in TP2 ranks forked from this process: the model handed back to the notebook is
    the quantized one (its recipe and tensors restored), and equals the ranks' (their last-step checkpoint
    would give the same: both are the gathered global tensors)."""
    from megatron_lite.data import MockGPTDataModule

    config = dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16)
    module = ml.GPTModule(ml.GPTConfig(**config), FINE_TUNE)
    data = MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=128, seed=3)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=2, start_method="fork"),
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Quantize("INT8_SMOOTHQUANT_CFG", calib_batches=1, eval_batches=1)],
    )
    trainer.fit(module, data)
    recipe = quantization_recipe(module.model)
    assert recipe is not None and recipe["config"] == "INT8_SMOOTHQUANT_CFG"
    amax = module.model.layers["0"].mlp.linear_fc2.input_quantizer.amax
    assert amax is not None and float(amax) > 0  # calibrated in the ranks, handed back
