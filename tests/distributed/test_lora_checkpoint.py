"""Adapter-only checkpoints of a LoRA run, through a real Trainer on a base loaded with ``from_pretrained``.

- What they hold: the adapters and the LoRA recipe, the adapters' optimizer state, the loop state, and the base's
  path and content hash; no base weight. A small fraction of the full checkpoint the same run writes from a base
  of unknown origin (which, as documented, holds the base too and still resumes).
- Exact resume: resumed from step 2 (with the adapters' dropout drawing from the restored RNG streams) the losses of
  the later steps and the final adapters equal the uninterrupted run's bit for bit, in one process and at TP2; a
  TP2 checkpoint resumed in one process continues the same training (fp32 tolerance).
- A different base (the base's files rewritten) is refused before any rank starts, and by from_pretrained, which
  takes the moved base as ``base=``.
- ``from_pretrained(adapter checkpoint)`` gives the trained model (its logits), and ``validate(ckpt_path=...)`` of a
  module of the same base without the LoRA callback rebuilds the adapters from the checkpoint.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from parity_utils import run, tiny_config

import megatron_lite as ml
from megatron_lite.callbacks import LoRA
from megatron_lite.cli.convert import to_hf
from megatron_lite.core.checkpoint.adapter_only import BASE_RECORD
from megatron_lite.core.checkpoint.fingerprint import WeightsSource, weights_hash
from megatron_lite.core.checkpoint.format.sharded import checkpoint_keys, read_checkpoint_meta
from megatron_lite.core.checkpoint.full.state import load_full_state
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.peft import adapters_disabled, apply_lora
from megatron_lite.core.peft.lora import LORA_RECIPE
from megatron_lite.data import MockGPTDataModule
from megatron_lite.pretrained import save_weights_checkpoint

CONFIG = tiny_config(
    num_layers=2, hidden_size=128, seq_length=16, vocab_size=1000, activation="swiglu", normalization="RMSNorm"
)
SAVE_AT, STEPS = 2, 4

pytestmark = pytest.mark.xdist_group("lora_checkpoint")


def _optimizer() -> ml.OptimizerConfig:
    return ml.OptimizerConfig(lr=2e-2, lr_warmup_iters=1, lr_decay_iters=20, min_lr=1e-3)


def _lora() -> LoRA:
    return LoRA(dim=2, alpha=4, dropout=0.1, target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])


class _Started(L.Callback):
    """Leaves a file when a rank sets up."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.marker.touch()


def _write_base(path: Path, seed: int) -> Path:
    module = ml.GPTModule(CONFIG, seed=seed)
    module.configure_model()
    return save_weights_checkpoint(module, path)


def _fit(out: Path, module: ml.GPTModule, ckpt_path=None, adapters: Optional[list] = None, **layout) -> dict:
    """Train ``module`` with ``adapters`` (default: :func:`_lora`'s), saving every SAVE_AT steps."""
    L.seed_everything(42)
    checkpoints = ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=SAVE_AT, save_top_k=-1)
    result = run(
        out,
        module=module,
        config=CONFIG,
        steps=STEPS,
        gbs=4,
        mbs=2,
        optimizer=_optimizer(),
        callbacks=[*(adapters if adapters is not None else [_lora()]), checkpoints],
        ckpt_path=ckpt_path,
        **layout,
    )
    result["checkpoint"] = out / "ckpts" / f"epoch=0-step={SAVE_AT}.ckpt"
    return result


def _data() -> MockGPTDataModule:
    return MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=1000, seed=7)


def _from_base(base: Path) -> ml.GPTModule:
    return ml.GPTModule.from_pretrained(base, optimizer=_optimizer())


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _assert_resumed_exactly(resumed: dict, reference: dict) -> None:
    assert resumed["global_step"] == STEPS
    assert resumed["losses"] == reference["losses"][SAVE_AT:]  # floats compared exactly
    assert resumed["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return _write_base(tmp_path_factory.mktemp("base") / "base", seed=5)


@pytest.fixture(scope="module")
def one_process(base, tmp_path_factory) -> dict:
    return _fit(tmp_path_factory.mktemp("one") / "run", _from_base(base))


def test_adapter_only_checkpoint_holds_the_adapters_and_names_the_base(base, one_process, tmp_path):
    checkpoint = one_process["checkpoint"]
    keys = checkpoint_keys(checkpoint)
    model = {k[len("model.model.") :] for k in keys if k.startswith("model.model.")}
    adapters = {n for n in one_process["params"] if ".adapter." in n}
    assert len(adapters) == 2 * 4 * CONFIG.num_layers
    assert model == adapters | {LORA_RECIPE}  # no base weight
    optimizer = [k for k in keys if k.startswith("optimizer_0.state.model.")]
    assert optimizer and all(".adapter." in k for k in optimizer)  # the adapters' optimizer state only
    meta = read_checkpoint_meta(checkpoint)
    assert meta["global_step"] == SAVE_AT and "lr_schedulers" in meta and "loops" in meta
    assert meta[BASE_RECORD]["path"] == str(base.absolute()) and len(meta[BASE_RECORD]["sha256"]) == 64

    # The same run on a base of unknown origin (built in this process): a full checkpoint, said once, still resumed
    handler = logging.FileHandler(tmp_path / "log.txt")  # the forked ranks inherit it
    logger = logging.getLogger("lightning.pytorch")  # where rank_zero_info logs (it does not propagate further)
    level = logger.level  # at INFO whatever an earlier test in this process left it at
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        full = _fit(tmp_path / "full", ml.GPTModule(CONFIG, optimizer=_optimizer(), seed=5))
    finally:
        logger.setLevel(level)
        logger.removeHandler(handler)
        handler.close()
    notes = [line for line in (tmp_path / "log.txt").read_text().splitlines() if "has no recorded source" in line]
    assert len(notes) == 1 and "full checkpoints" in notes[0], notes  # one line, once per run (two saves)
    full_meta = read_checkpoint_meta(full["checkpoint"])
    assert BASE_RECORD not in full_meta
    assert "model.model.embedding.weight" in checkpoint_keys(full["checkpoint"])
    assert full["losses"] == one_process["losses"]  # the same base values: the same training
    assert _bytes(checkpoint) < 0.1 * _bytes(full["checkpoint"]), (_bytes(checkpoint), _bytes(full["checkpoint"]))
    resumed = _fit(tmp_path / "full_resumed", ml.GPTModule(CONFIG, optimizer=_optimizer(), seed=5), full["checkpoint"])
    _assert_resumed_exactly(resumed, full)


def test_resume_from_an_adapter_only_checkpoint_is_exact(base, one_process, tmp_path):
    resumed = _fit(tmp_path, _from_base(base), ckpt_path=one_process["checkpoint"])
    _assert_resumed_exactly(resumed, one_process)


def test_resume_at_tp2_is_exact_and_continues_in_one_process(base, tmp_path):
    tp2 = _fit(tmp_path / "tp2", _from_base(base), devices=2, tp=2)
    resumed = _fit(tmp_path / "tp2_resumed", _from_base(base), ckpt_path=tp2["checkpoint"], devices=2, tp=2)
    _assert_resumed_exactly(resumed, tp2)
    # at another layout the dropout streams are re-derived from the seeds: the same training, other masks
    other = _fit(tmp_path / "one_resumed", _from_base(base), ckpt_path=tp2["checkpoint"])
    assert other["global_step"] == STEPS
    torch.testing.assert_close(torch.tensor(other["losses"]), torch.tensor(tp2["losses"][SAVE_AT:]), rtol=0.05, atol=0)


def test_resume_is_refused_without_the_same_adapters(base, one_process, tmp_path):
    # other targets: the base's entries come from the module, but the adapters must be exactly the checkpoint's
    other = LoRA(dim=2, alpha=4, dropout=0.1, target_modules=["linear_qkv"])
    checkpoint = one_process["checkpoint"]
    with pytest.raises(ValueError, match=r"does not fit GPTModule's model: unexpected 12 entries \(.*fc1\.adapter"):
        _fit(tmp_path / "other", _from_base(base), ckpt_path=checkpoint, adapters=[other])
    # no LoRA callback: refused before any rank starts
    with pytest.raises(ValueError, match="is a LoRA run's checkpoint, but the module's model has no adapters"):
        _fit(tmp_path / "none", _from_base(base), ckpt_path=checkpoint, adapters=[_Started(tmp_path / "started")])
    assert not (tmp_path / "started").exists()
    # a module whose base is of unknown origin cannot be the recorded base
    with pytest.raises(ValueError, match=r"the module's base has no recorded source .*from_pretrained\("):
        _fit(tmp_path / "unknown", ml.GPTModule(CONFIG, optimizer=_optimizer(), seed=5), ckpt_path=checkpoint)


def test_a_hugging_face_base_is_fingerprinted_by_its_weight_files(base, one_process, tmp_path):
    hf = Path(to_hf(str(base), str(tmp_path / "hf")).split(":")[0].removeprefix("wrote "))
    module = ml.GPTModule.from_pretrained(hf, optimizer=_optimizer(), seed=5)  # the seed of `base`'s runs
    assert module.pretrained_source._source is None  # not hashed by a plain load: only when a LoRA run needs it
    assert module.pretrained_source.source() == WeightsSource(str(hf.absolute()), weights_hash(hf))
    # the same weights as `base`: the same training, its checkpoint naming the HF directory
    last = _fit(tmp_path / "run", module)["checkpoint"].parent / f"epoch=0-step={STEPS}.ckpt"
    assert read_checkpoint_meta(last)[BASE_RECORD]["path"] == str(hf.absolute())
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length), generator=torch.Generator().manual_seed(0))
    expected = ml.GPTModule.from_pretrained(one_process["checkpoint"].parent / f"epoch=0-step={STEPS}.ckpt")
    torch.testing.assert_close(
        ml.GPTModule.from_pretrained(last).full_logits(tokens), expected.full_logits(tokens), rtol=1e-5, atol=1e-6
    )
    (hf / "config.json").write_text((hf / "config.json").read_text() + " ")  # not a weight: the same base
    assert weights_hash(hf) == module.pretrained_source.source().sha256
    weights = next(hf.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="are not the ones recorded"):
        ml.GPTModule.from_pretrained(last)
    # files changed between a load and the first LoRA save: what is in memory is not the files, so no base is named
    loaded = ml.GPTModule.from_pretrained(hf, optimizer=_optimizer(), seed=5)
    weights.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))
    assert loaded.pretrained_source.source() is None


def test_a_different_base_is_refused(base, tmp_path):
    trained_on = tmp_path / "base"
    shutil.copytree(base, trained_on)
    lora = _fit(tmp_path / "run", _from_base(trained_on))["checkpoint"]
    # the base's files are then rewritten with other weights
    shutil.rmtree(trained_on)
    save_weights_checkpoint(ml.GPTModule.from_pretrained(_write_base(tmp_path / "other", seed=6)), trained_on)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork"),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        callbacks=[_lora(), _Started(tmp_path / "started")],
        logger=False,
        enable_checkpointing=False,
    )
    with pytest.raises(ValueError, match="a different base") as refused:
        trainer.fit(_from_base(trained_on), _data(), ckpt_path=str(lora))
    assert not (tmp_path / "started").exists()  # refused in this process, before any rank started
    message = str(refused.value)
    assert f"from_pretrained({str(trained_on.absolute())!r})" in message and "\n" not in message

    # from_pretrained of the adapters checks the recorded base; base= points at where the right one is now
    with pytest.raises(ValueError, match=r"are not the ones recorded.*base=<that model's directory>"):
        ml.GPTModule.from_pretrained(lora)
    shutil.rmtree(trained_on)
    with pytest.raises(ValueError, match=r"does not exist.*base=<that model's directory>"):
        ml.GPTModule.from_pretrained(lora)
    adapted = ml.GPTModule.from_pretrained(lora, base=base)
    assert adapted.pretrained_source.source().sha256 == read_checkpoint_meta(lora)[BASE_RECORD]["sha256"]


def test_from_pretrained_and_validate_give_the_trained_model(base, one_process):
    # the trained model: the base with the run's final adapters, from the parameters the run recorded
    reference = ml.GPTModule(CONFIG, seed=5)
    reference.configure_model()
    apply_lora(reference.model, _lora().config, ParallelLayout.single(), seed=1234)
    load_full_state(reference.model, dict(one_process["params"]), vocab_size=CONFIG.vocab_size, strict=False)
    reference.model.eval()

    last = one_process["checkpoint"].parent / f"epoch=0-step={STEPS}.ckpt"
    adapted = ml.GPTModule.from_pretrained(last)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length), generator=torch.Generator().manual_seed(0))
    expected = reference.full_logits(tokens)
    torch.testing.assert_close(adapted.full_logits(tokens), expected, rtol=0, atol=0)
    with adapters_disabled(adapted.model):
        assert not torch.allclose(adapted.full_logits(tokens), expected)  # the adapters matter

    def validate(module, ckpt_path=None) -> float:
        trainer = L.Trainer(
            strategy=ml.MegatronStrategy(), accelerator="cpu", devices=1, limit_val_batches=2, logger=False
        )
        return trainer.validate(module, _data(), ckpt_path=ckpt_path, verbose=False)[0]["val/loss"]

    # a module of the same base without the LoRA callback: the adapters are rebuilt from the checkpoint's recipe
    assert validate(_from_base(base), ckpt_path=str(last)) == validate(adapted)
