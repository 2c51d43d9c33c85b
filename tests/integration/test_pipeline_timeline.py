"""Pipeline events of a real PP2 fit (fork-launched ranks, real files) and ``megatron-lite pipeline-timeline``
on them: the recorded schedule is the one that ran, the CLI prints a bubble and writes a PNG, and bad input
says how to fix it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import lightning as L
import pytest
from PIL import Image

import megatron_lite as ml
from megatron_lite import cli
from megatron_lite.callbacks import PipelineTimeline
from megatron_lite.cli.pipeline_timeline import main
from megatron_lite.core.parallel.pipeline.schedules import interleaved_order, one_f_one_b_order
from megatron_lite.data import MockGPTDataModule

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))
from parity_utils import tiny_config  # noqa: E402

P, M, STEPS, RECORDED = 2, 4, 3, [0, 2]


def _fit(root: Path, devices: int, pp: int, vpp: int = 1, callback=None) -> L.Trainer:
    config = tiny_config(num_layers=4)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            # one process: in this one (a fork would take its warnings away)
            start_method="fork" if devices > 1 else "popen",
            log_metrics=False,
        ),
        accelerator="cpu",
        devices=devices,
        max_steps=STEPS,
        logger=False,
        default_root_dir=root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[callback or PipelineTimeline(steps=RECORDED)],
    )
    data = MockGPTDataModule(
        seq_length=config.seq_length, micro_batch_size=2, global_batch_size=2 * M, vocab_size=config.vocab_size, seed=7
    )
    trainer.fit(ml.GPTModule(config, ml.OptimizerConfig(lr=1e-3)), data)
    return trainer


@pytest.fixture(scope="module", params=[1, 2], ids=["1f1b", "interleaved_v2"])
def run_dir(request, tmp_path_factory):
    """A PP2 fit of STEPS steps (M microbatches each) recording steps RECORDED into the Trainer's log_dir
    (default_root_dir: no logger)."""
    root = tmp_path_factory.mktemp(f"timeline_v{request.param}")
    _fit(root, devices=P, pp=P, vpp=request.param)
    return root, request.param


def _records(root: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (root / "pipeline_events" / f"rank{rank}.jsonl").read_text().splitlines()]


def test_every_rank_records_the_schedule_that_ran(run_dir):
    root, vpp = run_dir
    assert sorted(p.name for p in (root / "pipeline_events").iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    by_rank = {rank: _records(root, rank) for rank in range(P)}
    for rank, records in by_rank.items():
        assert [r["step"] for r in records] == RECORDED  # steps=[0, 2]: step 1 left out
        for record in records:
            assert record["rank"] == rank and record["coords"]["pp"] == rank
            assert (record["coords"]["tp"], record["coords"]["dp"]) == (0, 0)
            assert (record["pp_size"], record["virtual_pipeline_size"], record["num_microbatches"]) == (P, vpp, M)
            assert record["schedule"] == ("1f1b" if vpp == 1 else "interleaved_1f1b")
            events = record["events"]
            # every microbatch once forward and once backward through each of this rank's chunks
            for kind in "FB":
                assert sorted((e["microbatch"], e["chunk"]) for e in events if e["kind"] == kind) == [
                    (m, c) for m in range(M) for c in range(vpp)
                ]
            # in the schedule's order (Megatron's 1F1B / interleaved 1F1B), one after another in time
            order = [(e["kind"], e["chunk"], e["microbatch"]) for e in events]
            expected = one_f_one_b_order(M, P, rank) if vpp == 1 else interleaved_order(M, P, rank, vpp)
            assert order == expected
            assert all(e["start"] <= e["end"] for e in events)
            assert all(a["end"] <= b["start"] for a, b in zip(events, events[1:]))
            done = {}
            for e in events:  # a forward before its backward
                done[(e["kind"], e["chunk"], e["microbatch"])] = e
                if e["kind"] == "B":
                    assert done[("F", e["chunk"], e["microbatch"])]["end"] <= e["start"]
    # Across ranks (one clock): an event starts once its input has arrived, so after the event that sends it
    # started. (Not after it ended: the sender's clock read follows the posted send, and a loaded machine may
    # run the receiver first.)
    for step in range(len(RECORDED)):
        by_stage = {}
        for rank in range(P):
            for e in by_rank[rank][step]["events"]:
                by_stage[(e["kind"], e["virtual_stage"], e["microbatch"])] = e
        for (kind, stage, mb), e in by_stage.items():
            source = (kind, stage - 1 if kind == "F" else stage + 1, mb)
            if source in by_stage:
                assert by_stage[source]["start"] < e["start"], f"{kind}{mb} on virtual stage {stage} started early"


def test_cli_prints_the_bubble_and_writes_a_png(run_dir, tmp_path, capsys):
    """Through the CLI's entry (`megatron-lite pipeline-timeline`), in this process: `python -m megatron_lite`
    runs its tools as processes in test_generation_trainer.py and test_trainer_and_cli.py."""
    root, vpp = run_dir
    out = tmp_path / "timeline.png"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_code:
        cli.main(["pipeline-timeline", str(root), "--out", str(out)])
    proc = capsys.readouterr()
    assert exit_code.value.code == 0, proc.err[-3000:]
    assert proc.out.startswith(f"step {RECORDED[-1]}: ")  # the last recorded step by default
    measured = float(re.search(r"bubble fraction: measured ([0-9.]+)", proc.out).group(1))
    assert 0.0 < measured < 1.0
    formula = "(P-1)/(M+P-1)" if vpp == 1 else "(P-1)/(V*M+P-1)"
    theory = (P - 1) / (vpp * M + P - 1)
    assert f"theory {formula} = {theory:.4f}" in proc.out
    assert f"wrote {out}" in proc.out
    with Image.open(out) as image:
        assert image.format == "PNG"
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16)) > 10  # drawn, not a blank canvas


def test_step_choice_and_default_output(run_dir, capsys):
    root, _ = run_dir
    assert main([str(root), "--step", "0"]) == 0
    assert capsys.readouterr().out.startswith("step 0: ")
    assert (root / "pipeline_timeline_step0.png").is_file()
    assert main([str(root.parent), "--step", "1"]) == 2  # a parent directory: the events are found below it
    assert "step 1 was not recorded; recorded steps: 0, 2" in capsys.readouterr().err


def test_run_dir_without_events_says_how_to_record(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no pipeline events under" in err and "callbacks=[megatron_lite.callbacks.PipelineTimeline()]" in err
    assert main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_without_pipeline_nothing_is_recorded(tmp_path):
    with pytest.warns(UserWarning, match="no pipeline schedule to record"):
        _fit(tmp_path, devices=1, pp=1, callback=PipelineTimeline(dirpath=tmp_path / "events"))
    assert not (tmp_path / "events" / "pipeline_events").exists()


def test_every_n_steps_and_bad_options():
    timeline = PipelineTimeline(every_n_steps=2)
    assert [s for s in range(6) if timeline.records(s)] == [0, 2, 4]
    with pytest.raises(ValueError, match="every_n_steps must be a positive integer"):
        PipelineTimeline(every_n_steps=0)


def test_without_matplotlib_the_bubble_prints_and_one_line_says_what_to_install(run_dir, tmp_path, capsys, monkeypatch):
    root, _ = run_dir
    # None in sys.modules makes the import fail as it does where matplotlib is not installed
    for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, name, None)
    assert main([str(root), "--out", str(tmp_path / "t.png")]) == 2
    captured = capsys.readouterr()
    assert "bubble fraction: measured" in captured.out
    assert captured.err.strip().count("\n") == 0 and 'pip install "megatron-lite[logging]"' in captured.err
    assert not (tmp_path / "t.png").exists()
