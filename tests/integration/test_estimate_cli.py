"""``megatron-lite estimate``: real YAML configs in, the estimator's numbers out; bad input exits 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_lite.cli.estimate import main
from megatron_lite.core.estimator import estimate_for_run, training_flops_per_step
from megatron_lite.core.models import GPTConfig
from megatron_lite.core.optim import OptimizerConfig
from megatron_lite.core.parallel import ParallelConfig
from megatron_lite.core.parallel.geometry import DataGeometry
from megatron_lite.core.parallel.run_spec import RunSpec

REPO = Path(__file__).resolve().parents[2]
TINY_YAML = REPO / "examples" / "configs" / "gpt_tiny.yaml"
JSON_KEYS = {
    "params",
    "weights_bytes",
    "grads_bytes",
    "optimizer_bytes",
    "activation_bytes",
    "total_bytes",
    "flops_per_step",
    "optimizer_bytes_replicated",
    "optimizer_bytes_distributed",
}


def _run_json(capsys, *args: str) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _write(tmp_path: Path, edit) -> Path:
    raw = yaml.safe_load(TINY_YAML.read_text())
    edit(raw)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_json_per_rank_numbers_are_the_estimators_for_the_example_config(capsys):
    out = _run_json(capsys, "--config", str(TINY_YAML), "--device-memory-gib", "80")
    assert JSON_KEYS <= out.keys()
    raw = yaml.safe_load(TINY_YAML.read_text())
    # What `megatron-lite fit` builds from this file: the data's seq_length and vocabulary linked into the model.
    data = raw["data"]["init_args"]
    config = GPTConfig(**raw["model"]["config"], seq_length=data["seq_length"], vocab_size=data["vocab_size"])
    run = RunSpec(
        ParallelConfig(tensor_model_parallel_size=2),
        world_size=2,
        precision="32-true",
        data=DataGeometry(data["micro_batch_size"], data["global_batch_size"], config.seq_length),
    )
    expected = estimate_for_run(config, run, OptimizerConfig(**raw["model"]["optimizer"]), device_type="cpu")
    for key in ("params", "weights_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "total_bytes"):
        assert out[key] == getattr(expected, key), key
    assert out["flops_per_step"] == training_flops_per_step(
        config, data["global_batch_size"], tensor_model_parallel_size=2
    )
    assert out["world_size"] == 2 and out["layout"]["tensor_model_parallel_size"] == 2
    assert out["vocab_size"] == 2048 and out["vocab_size_source"] == "data.init_args.vocab_size"
    assert out["warning"] is None


def test_devices_distributed_optimizer_and_recompute_from_the_yaml(capsys, tmp_path):
    def edit(raw):
        raw["model"]["optimizer"]["use_distributed_optimizer"] = True
        raw["model"]["config"].update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)

    plain = _run_json(capsys, "--config", str(TINY_YAML), "--devices", "4")
    out = _run_json(capsys, "--config", str(_write(tmp_path, edit)), "--devices", "4")
    assert out["layout"]["data_parallel_size"] == 2 and out["layout"]["use_distributed_optimizer"]
    assert out["optimizer_bytes"] == out["optimizer_bytes_distributed"] < out["optimizer_bytes_replicated"]
    # fp32 weights are their own main copy: Adam's two moments (8 bytes) split over 2 ranks
    assert out["optimizer_bytes_distributed"] == -(-out["params"] // 2) * 8
    assert out["activation_bytes"] < plain["activation_bytes"]
    assert out["activation_breakdown"]["recompute"].startswith("full, uniform")


def test_table_and_a_warning_when_the_total_exceeds_the_device_memory(capsys):
    assert main(["--config", str(TINY_YAML), "--device-memory-gib", "0.01"]) == 0
    captured = capsys.readouterr()
    for row in ("parameters", "weights", "gradients", "optimizer state", "activations", "total", "FLOPs per step"):
        assert row in captured.out
    assert "without distributed optimizer" in captured.out
    warning = [line for line in captured.err.splitlines() if line.startswith("WARNING")]
    assert len(warning) == 1 and "exceeds the device memory 10.24 MiB" in warning[0]
    assert main(["--config", str(TINY_YAML), "--device-memory-gib", "80"]) == 0
    assert "WARNING" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "edit, args, message",
    [
        (
            lambda raw: raw["trainer"]["strategy"]["init_args"].update(tensor_model_parallel_size=8),
            ["--devices", "8"],
            "num_attention_heads (4) must be divisible by tensor_model_parallel_size (8)",
        ),
        (None, ["--devices", "3"], "must be divisible by the model-parallel size"),
        (
            lambda raw: raw["data"]["init_args"].update(global_batch_size=12),
            ["--devices", "4"],
            "global_batch_size (12) must be divisible by micro_batch_size (8) x data-parallel size (2)",
        ),
        (
            lambda raw: raw["model"]["config"].update(hidden_sise=64),
            [],
            "model.config has unknown keys ['hidden_sise']",
        ),
        (lambda raw: raw["trainer"].update(devices="auto"), [], "pass --devices N"),
        (lambda raw: raw["trainer"].update(precision="fp8"), [], "unknown precision 'fp8'"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_fix(capsys, tmp_path, edit, args, message):
    path = _write(tmp_path, edit) if edit is not None else TINY_YAML
    assert main(["--config", str(path), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and message in captured.err


def test_missing_and_unparsable_files_exit_2(capsys, tmp_path):
    assert main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is not valid YAML" in err


def test_the_strategy_makes_the_estimate_when_fit_starts(tmp_path):
    """The strategy estimates the run from the live configs before the first step (and logs the table):
    the same numbers as the estimator called with the run's sizes."""
    import lightning as L
    import torch

    import megatron_lite as ml
    from megatron_lite.core.estimator.run import estimate_for_run
    from megatron_lite.data import MockGPTDataModule

    class Keep(L.Callback):
        def on_fit_start(self, trainer, pl_module):  # in the forked rank: hand the estimate back
            torch.save(trainer.strategy.memory_estimate.to_dict(), tmp_path / "estimate.pt")

    config = ml.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=16)
    optimizer = ml.OptimizerConfig(use_distributed_optimizer=True)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", log_metrics=False),
        devices=2,
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Keep()],
    )
    trainer.fit(
        ml.GPTModule(config, optimizer),
        MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=8, vocab_size=256),
    )
    run = RunSpec(ParallelConfig(), world_size=2, data=DataGeometry(2, 8, 16))
    expected = estimate_for_run(config, run, optimizer, device_type="cpu").to_dict()
    assert torch.load(tmp_path / "estimate.pt", weights_only=False) == expected


def _pipeline(raw: dict, **options) -> None:
    raw["trainer"]["strategy"]["init_args"].update(tensor_model_parallel_size=1, **options)
    raw["data"]["init_args"].update(micro_batch_size=2, global_batch_size=16)  # 8 microbatches per step


@pytest.mark.parametrize(
    "options, stage_layers",
    [
        (dict(pipeline_model_parallel_size=2), [[0, 1], [2, 3]]),
        (dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1), [[0], [1, 2, 3]]),
        (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), [[0, 2], [1, 3]]),
        (dict(pipeline_model_parallel_size=2, pipeline_schedule="gpipe"), [[0, 1], [2, 3]]),
        (  # rank 0: the embedding alone, then layers 2-3; rank 1: layers 0-1, then the loss alone
            dict(
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
                pipeline_model_parallel_layout="E|tt|tt|L",
            ),
            [[2, 3], [0, 1]],
        ),
    ],
)
def test_pipeline_options_from_the_yaml_give_one_estimate_per_stage(capsys, tmp_path, options, stage_layers):
    path = _write(tmp_path, lambda raw: _pipeline(raw, **options))
    out = _run_json(capsys, "--config", str(path))
    raw = yaml.safe_load(path.read_text())
    data = raw["data"]["init_args"]
    config = GPTConfig(**raw["model"]["config"], seq_length=data["seq_length"], vocab_size=data["vocab_size"])
    run = RunSpec(
        ParallelConfig(**options),
        world_size=options["pipeline_model_parallel_size"],
        data=DataGeometry(2, 16, config.seq_length),
    )
    expected = estimate_for_run(config, run, OptimizerConfig(**raw["model"]["optimizer"]), device_type="cpu")
    assert [s["pipeline_stage"] for s in out["stages"]] == [0, 1]
    assert out["stages"] == expected.to_dict()["stages"]
    assert out["total_bytes"] == max(s["total_bytes"] for s in out["stages"])
    assert [
        [c["first_layer"] + i for c in s["activation_breakdown"]["chunks"] for i in range(c["num_layers"])]
        for s in out["stages"]
    ] == stage_layers
    vpp = options.get("virtual_pipeline_model_parallel_size", 1)
    assert out["layout"]["virtual_pipeline_model_parallel_size"] == vpp
    assert main(["--config", str(path)]) == 0
    table = capsys.readouterr().out
    stage_rows = [line for line in table.splitlines() if line.startswith(("  0 ", "  1 "))]
    assert len(stage_rows) == 2 and sum("<- most loaded" in row for row in stage_rows) == 1


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(virtual_pipeline_model_parallel_size=2), "needs pipeline_model_parallel_size > 1"),
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_schedule="gpipe"),
            "use pipeline_schedule='interleaved_1f1b'",
        ),
        (dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=5), "must split evenly"),
        (dict(pipeline_model_parallel_size=3), "num_layers (4) must be divisible by pipeline_model_parallel_size (3)"),
        (
            dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tL"),
            "holds 2 transformer layers ('t'), but num_layers is 4",
        ),
    ],
)
def test_bad_pipeline_options_exit_2_with_one_line(capsys, tmp_path, options, message):
    path = _write(tmp_path, lambda raw: _pipeline(raw, **options))
    assert main(["--config", str(path), "--devices", str(options.get("pipeline_model_parallel_size", 1))]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err


def test_the_strategy_estimates_every_pipeline_stage_when_fit_starts(tmp_path):
    """PP2 with an uneven cut: the strategy passes its pipeline options, so the start-up estimate is the
    estimator's per-stage one (the most loaded stage, every stage in .stages)."""
    import lightning as L
    import torch

    import megatron_lite as ml
    from megatron_lite.data import MockGPTDataModule

    class Keep(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            estimate = trainer.strategy.memory_estimate
            torch.save(estimate.to_dict(), tmp_path / f"estimate{trainer.global_rank}.pt")

    config = ml.GPTConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=16)
    strategy = dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", log_metrics=False, **strategy),
        devices=2,
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Keep()],
    )
    trainer.fit(
        ml.GPTModule(config), MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=8, vocab_size=256)
    )
    run = RunSpec(ParallelConfig(**strategy), world_size=2, data=DataGeometry(2, 8, 16))
    expected = estimate_for_run(config, run, device_type="cpu").to_dict()
    for rank in range(2):
        assert torch.load(tmp_path / f"estimate{rank}.pt", weights_only=False) == expected
    assert [s["activation_breakdown"]["chunks"][0]["num_layers"] for s in expected["stages"]] == [1, 2]
    assert [s["activation_breakdown"]["microbatches_in_flight"] for s in expected["stages"]] == [2, 1]


def _edited(tmp_path: Path, source: Path, edit) -> Path:
    raw = yaml.safe_load(source.read_text())
    edit(raw)
    path = tmp_path / source.name
    path.write_text(yaml.safe_dump(raw))
    return path


def test_dpo_is_estimated_with_both_sequences_of_a_pair_and_its_reference_model(capsys, tmp_path):
    """examples/configs/dpo.yaml (8 pairs per microbatch, 32 per step, TP2): a pair is a microbatch's two rows,
    and per step 2 x (3 + 1) forwards of a sequence with the reference model kept -- whose weights are held
    too -- or 2 x 3 with its log-probs precomputed (its model freed before training)."""
    source = REPO / "examples" / "configs" / "dpo.yaml"
    outs = {}
    for precompute in (False, True):

        def edit(raw, precompute=precompute):
            raw["model"]["init_args"]["precompute_reference_log_probs"] = precompute

        outs[precompute] = _run_json(capsys, "--config", str(_edited(tmp_path, source, edit)))
    raw = yaml.safe_load(source.read_text())
    model, data = raw["model"]["init_args"], raw["data"]["init_args"]
    config = GPTConfig(**model["config"], seq_length=data["seq_length"], vocab_size=64)
    per_sequence = training_flops_per_step(config, 1, tensor_model_parallel_size=2) / 3
    live, precomputed = outs[False], outs[True]
    assert live["objective"] == "DPOModule" and live["objective_cost"]["frozen_models"] == 1
    assert live["flops_per_step"] == pytest.approx(2 * (3 + 1) * per_sequence * data["global_batch_size"], rel=1e-12)
    assert precomputed["flops_per_step"] == pytest.approx(2 * 3 * per_sequence * data["global_batch_size"], rel=1e-12)
    doubled = DataGeometry(2 * data["micro_batch_size"], 2 * data["global_batch_size"], config.seq_length)
    expected = estimate_for_run(  # the same run's memory with microbatches of twice the rows
        config,
        RunSpec(ParallelConfig(tensor_model_parallel_size=2), world_size=2, data=doubled),
        OptimizerConfig(**model["optimizer"]),
        device_type="cpu",
    )
    for out in (live, precomputed):
        assert out["layout"]["micro_batch_size"] == 2 * data["micro_batch_size"]
        assert out["activation_bytes"] == expected.activation_bytes
    assert live["frozen_bytes"] == live["weights_bytes"] > 0 and precomputed["frozen_bytes"] == 0
    assert live["total_bytes"] - precomputed["total_bytes"] == live["weights_bytes"] == expected.weights_bytes


def test_grpo_is_estimated_with_the_group_of_every_prompt(capsys):
    """examples/configs/grpo.yaml: 16 prompts per rollout, 16 samples each, one update, no reference model:
    per prompt 16 sequences x (3 + 1 old-log-prob forward)."""
    out = _run_json(capsys, "--config", str(REPO / "examples" / "configs" / "grpo.yaml"))
    raw = yaml.safe_load((REPO / "examples" / "configs" / "grpo.yaml").read_text())
    data = raw["data"]["init_args"]
    config = GPTConfig(
        **raw["model"]["init_args"]["config"], seq_length=data["seq_length"], vocab_size=out["vocab_size"]
    )
    per_sequence = training_flops_per_step(config, 1) / 3
    assert out["flops_per_step"] == pytest.approx(16 * (3 + 1) * per_sequence * data["global_batch_size"], rel=1e-12)
    assert out["layout"]["micro_batch_size"] == 16 * data["micro_batch_size"] and out["frozen_bytes"] == 0
