"""Pruning a model trained by a real Trainer on text: the layer that activation statistics rank least important
costs less held-out loss to drop than the most important one and than a layer picked at random (the mean over
all); ``megatron-lite prune`` writes an ordinary checkpoint that ``GPTModule.from_pretrained``,
``trainer.validate(ckpt_path=...)`` and ``megatron-lite generate`` read, and refuses bad input in one line;
distilling the pruned model from the original (``Distill``) for 20 steps recovers more than half of the held-out
loss the pruning cost, and more than 20 steps of training on the data alone; a pruned checkpoint (whose head width
no longer follows hidden / heads) trains at TP2 to the same weights as in one process."""

from __future__ import annotations

import gzip
import json

import lightning as L
import pytest
import torch

import megatron_lite as ml
from megatron_lite import cli
from megatron_lite.data import TextCorpusDataModule
from megatron_lite.data.bundled import bundled_corpus
from megatron_lite.post_training.pruning import PruneTarget, apply_plan, estimate_importance, plan_pruning

CONFIG = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    seq_length=32,
    make_vocab_size_divisible_by=64,
)


STEPS = 100  # enough for the layers to differ clearly and the model to be worth distilling from


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        strategy=ml.MegatronStrategy(),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint, corpus, datamodule) of 100 steps on 300 KB of the bundled corpus (its own small tokenizer)."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("pruning")
    with gzip.open(bundled_corpus("shakespeare"), "rt") as f:
        text = "".join(json.loads(line)["text"] for line in f)[:300_000]
    corpus = out / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text[i : i + 3000]}) + "\n" for i in range(0, len(text), 3000)))
    data = TextCorpusDataModule(
        str(corpus),
        seq_length=32,
        micro_batch_size=8,
        global_batch_size=8,
        vocab_size=320,
        cache_dir=str(out / "cache"),
        split="90,10",
    )
    module = ml.GPTModule(
        ml.GPTConfig(vocab_size=320, **CONFIG),
        ml.OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=5, lr_decay_style="cosine"),
    )
    trainer = _trainer(max_steps=STEPS, limit_val_batches=0)
    trainer.fit(module, data)
    trainer.save_checkpoint(out / "ckpt")
    return out / "ckpt", corpus, data


def _rows(dataset, n: int = 64, batch: int = 8) -> list[dict]:
    rows = [dataset[i]["tokens"] for i in range(n)]
    return [{"tokens": torch.stack(rows[i : i + batch])} for i in range(0, n, batch)]


def _loss(module, batches) -> float:
    with torch.no_grad():
        return float(
            torch.cat([module.model(b["tokens"][:, :-1], b["tokens"][:, 1:]).reshape(-1) for b in batches]).mean()
        )


def test_dropping_the_least_important_layer_costs_least(trained):
    checkpoint, _, data = trained
    module = ml.GPTModule.from_pretrained(checkpoint)
    calibration, held_out = _rows(data.train_dataset), _rows(data.val_dataset)
    importance = estimate_importance(module, calibration, "cosine")
    ranking = sorted(range(4), key=lambda i: float(importance.layers[i]))
    costs = {}
    for layer in range(4):  # drop each layer in turn (a plan ranking that layer last) and measure held-out loss
        forced = type(importance)(**{**vars(importance), "layers": torch.tensor([float(i != layer) for i in range(4)])})
        pruned = apply_plan(module, plan_pruning(module.config, forced, PruneTarget(num_layers=3)))
        assert [i for i in range(4) if i != layer] == plan_pruning(
            module.config, forced, PruneTarget(num_layers=3)
        ).layers
        costs[layer] = _loss(pruned, held_out) - _loss(module, held_out)
    print(f"cosine importance {importance.layers.tolist()}; held-out loss increase when dropped {costs}")
    least, most = ranking[0], ranking[-1]
    assert costs[least] < costs[most]
    assert costs[least] < sum(costs.values()) / 4  # a layer picked at random costs this on average


def test_cli_prunes_to_an_ordinary_checkpoint(trained, tmp_path, capsys):
    checkpoint, corpus, data = trained
    out = tmp_path / "pruned"
    args = [
        "prune",
        "--ckpt",
        str(checkpoint),
        "--data",
        str(corpus),
        "--num-layers",
        "3",
        "--hidden-size",
        "48",
        "--num-attention-heads",
        "2",
        "--ffn-hidden-size",
        "96",
        "--calib-batches",
        "4",
        "--output",
        str(out),
        "--json",
    ]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    before, after = summary["held_out_loss"]
    print(f"megatron-lite prune: parameters {summary['parameters']}, held-out loss {before:.4f} -> {after:.4f}")
    assert summary["shape"]["num_layers"] == [4, 3] and summary["parameters"][1] < summary["parameters"][0]

    pruned = ml.GPTModule.from_pretrained(out)
    c = pruned.config
    assert (
        c.num_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_query_groups,
        c.ffn_hidden_size,
        c.kv_channels,
    ) == (3, 48, 2, 2, 96, 16)
    # The Trainer reads it as it reads any checkpoint: weights and config, no optimizer state needed.
    trainer = _trainer(limit_val_batches=2)
    metrics = trainer.validate(ml.GPTModule(c), data, ckpt_path=str(out), verbose=False)[0]
    assert metrics["val/loss"] == pytest.approx(_loss(pruned, _rows(data.val_dataset, n=16)), rel=1e-4)

    with pytest.raises(SystemExit) as exit_info:  # the checkpoint kept the source's tokenizer
        cli.main(["generate", "--ckpt", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "4", "--json"])
    assert exit_info.value.code == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(record["new_tokens"]) == 4


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num-layers", "9"], "larger than the model's num_layers (4)"),
        (["--num-attention-heads", "3"], "must be a multiple of num_query_groups"),
        (["--data", "nowhere.jsonl"], "not an indexed dataset prefix"),
        (["--calib-batches", "5000"], "lower --calib-batches"),
    ],
)
def test_cli_bad_input_is_one_line(trained, tmp_path, capsys, extra, message):
    checkpoint, corpus, _ = trained
    args = ["prune", "--ckpt", str(checkpoint), "--data", str(corpus), "--output", str(tmp_path / "out")]
    if "--num-" not in " ".join(extra):
        args += ["--num-layers", "3"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args + extra)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_distillation_from_the_original_recovers_most_of_the_pruning_gap(trained, tmp_path):
    from megatron_lite.callbacks import Distill

    checkpoint, corpus, data = trained
    original = ml.GPTModule.from_pretrained(checkpoint)
    held_out = _rows(data.val_dataset)
    target = PruneTarget(num_layers=3, hidden_size=48, num_attention_heads=2, ffn_hidden_size=64)
    plan = plan_pruning(original.config, estimate_importance(original, _rows(data.train_dataset)), target)
    losses = {"original": _loss(original, held_out), "pruned": _loss(apply_plan(original, plan), held_out)}
    for name, callbacks in (("fine-tuned alone", []), ("distilled", [Distill(str(checkpoint))])):
        student = apply_plan(original, plan).train()  # from eval mode (as loaded): Distill teaches in training mode
        student.optimizer_config = ml.OptimizerConfig(lr=2e-3, lr_decay_style="constant")
        _trainer(max_steps=20, limit_val_batches=0, callbacks=callbacks).fit(student, data)
        losses[name] = _loss(student.eval(), held_out)
    gap = losses["pruned"] - losses["original"]
    print("held-out loss " + ", ".join(f"{k} {v:.4f}" for k, v in losses.items()))
    assert gap > 0.1  # the pruning cost something worth recovering
    assert losses["distilled"] - losses["original"] < 0.5 * gap  # most of the gap recovered (here: all of it)
    assert losses["distilled"] < losses["fine-tuned alone"]  # by the teacher, not only by more steps on the data


def test_a_pruned_checkpoint_trains_at_tp2_as_in_one_process(trained, tmp_path):
    from megatron_lite.pretrained import save_weights_checkpoint

    checkpoint, _, data = trained
    original = ml.GPTModule.from_pretrained(checkpoint)
    # hidden 48 with 2 heads of 16 channels: the head width no longer follows hidden / heads
    target = PruneTarget(num_layers=3, hidden_size=48, num_attention_heads=2, ffn_hidden_size=64)
    plan = plan_pruning(original.config, estimate_importance(original, _rows(data.train_dataset, n=16)), target)
    save_weights_checkpoint(apply_plan(original, plan), tmp_path / "pruned")
    trained_params = []  # after 3 steps in one process, then at TP2 (the forked ranks hand the model back)
    for devices in (1, 2):
        student = ml.GPTModule.from_pretrained(tmp_path / "pruned").train()
        student.optimizer_config = ml.OptimizerConfig(lr=2e-3, lr_decay_style="constant")
        strategy = ml.MegatronStrategy(tensor_model_parallel_size=devices, start_method="fork")
        L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=devices,
            max_steps=3,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
        ).fit(student, data)
        trained_params.append({n: p.detach().clone() for n, p in student.model.named_parameters()})
    assert trained_params[0].keys() == trained_params[1].keys()
    for name, value in trained_params[0].items():
        # the same updates up to reduction order (Adam's normalisation magnifies 1e-7 gradient noise to ~1e-6)
        torch.testing.assert_close(trained_params[1][name], value, rtol=1e-5, atol=1e-5, msg=name)
    start = ml.GPTModule.from_pretrained(tmp_path / "pruned").model.state_dict()
    assert all(not torch.equal(start[name], value) for name, value in trained_params[0].items())  # it trained
