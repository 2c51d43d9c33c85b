"""`make gpu-check` (benchmarks/gpu_check.py) is ready for the first GPU we get: its CPU smoke mode runs every
section end to end at tiny shapes, in this process (no GPU here; what the check measures on one: docs/benchmarks.md,
"One-GPU check"). tests/gpu itself is left out here: without CUDA all it does is skip."""

import json
import logging
from pathlib import Path

from megatron_lite import GPTConfig

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_cpu_smoke_run_measures_every_section_or_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check

    out = tmp_path / "gpu_check.json"
    levels = {name: logging.getLogger(name).level for name in ("lightning.pytorch", "lightning.fabric")}
    result = gpu_check.main(["--cpu-smoke", "--skip-tests", "--out", str(out)])
    # it quiets Lightning while it runs and puts the levels back: left at WARNING, the INFO lines later tests of this
    # worker read were gone (CI once failed so)
    assert {name: logging.getLogger(name).level for name in levels} == levels
    assert json.loads(out.read_text())["mode"] == "cpu-smoke"
    sections = result["sections"]
    assert sections["tests_gpu"]["status"] == "skipped" and sections["tests_gpu"]["reason"] == "--skip-tests"
    assert sections["fp8"]["status"] == "skipped" and "CUDA" in sections["fp8"]["reason"]
    measured = {name for name, s in sections.items() if s["status"] == "measured"}
    assert measured == set(gpu_check.SECTIONS) - {"fp8"}, {n: s.get("reason") for n, s in sections.items()}
    assert all(
        line.split(":")[0] in ("every figure", "peak memory per run", "tests_gpu", "fp8", "attention")
        for line in result["not_measured"]
    )

    # the plain loop and GPTModule ran the same model on the same batches, and so did the recompute and the
    # distributed-optimizer runs: their figures compare like with like
    training = sections["training"]
    assert training["max_loss_difference"] <= 1e-6
    assert training["num_parameters"] == GPTConfig(**gpu_check.SMOKE_SIZES.model).num_parameters()
    for name in ("selective", "full"):
        assert sections["recompute"][name]["max_loss_difference_vs_none"] <= 1e-6
    assert sections["distributed_optimizer"]["max_loss_difference_vs_none"] <= 1e-6
    for run in (training["plain"], training["megatron"]):
        assert run["timed_steps"] == gpu_check.SMOKE_SIZES.steps - gpu_check.SMOKE_SIZES.warmup
        assert 0 < run["mfu"] and run["tflops_per_device"] > 0
    # generation compared the same weights: greedy tokens equal transformers' (bf16 on both sides)
    generation = sections["generation"]
    assert generation["greedy_tokens_equal_for"] == generation["new_tokens"]
    assert set(generation["ratios"]) == {f"batch {b}" for b in gpu_check.SMOKE_SIZES.batches}
    # the SDPA paths the CPU has ran; the CUDA-only ones are named as unavailable, with torch's reason
    backends = sections["attention"]["backends"]
    assert backends["default"]["available"] and backends["math"]["available"]
    assert not backends["efficient"]["available"] and backends["efficient"]["reason"]
    checkpoint = sections["checkpoint"]
    assert checkpoint["ours_save"]["gb_per_s"] > 0 and checkpoint["ours_load"]["gb_per_s"] > 0
    printed = capsys.readouterr().out
    for row in ("training step: GPTModule + Megatron", "greedy decode: ours, batch 1", "checkpoint load: ours / torch"):
        assert row in printed
    assert "fp8: skipped: needs CUDA" in printed
