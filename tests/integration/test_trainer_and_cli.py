"""The strategy by name, the CLI refusing a missing corpus, and checkpoint save/resume, end to end (every command of
the example configs runs in test_example_config_commands.py)."""

import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import megatron_lite as ml
from megatron_lite import cli
from megatron_lite.data import MockGPTDataModule

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))
from parity_utils import assert_same_training, run, tiny_config  # noqa: E402


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MASTER_PORT", None)  # let the launcher pick a free port
    return env


def test_strategy_by_name_in_a_script(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/integration/train_by_name.py"), str(out)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["strategy"] == "MegatronStrategy"
    assert (result["world_size"], result["dp"], result["tp"]) == (2, 2, 1)
    assert result["cluster"] == "LightningEnvironment"  # Lightning's own launcher started the second rank
    assert len(result["losses"]) == 3 and all(5.0 < x < 6.0 for x in result["losses"])  # ~ln(256)


def test_fork_name_resolves():
    trainer = L.Trainer(strategy="megatron_fork", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ml.MegatronStrategy)
    assert trainer.strategy.options.start_method == "fork"


def test_cli_reports_missing_corpus_before_training(tmp_path, monkeypatch, capsys):
    """One line, no traceback (the CLI's entry in this process: the error comes before any launch)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_code:
        cli.main(
            [
                "fit",
                "--config",
                str(REPO / "examples/configs/gpt_tiny.yaml"),
                "--data.init_args.path",
                str(tmp_path / "nope.jsonl"),
            ]
        )
    err = capsys.readouterr().err
    assert exit_code.value.code != 0
    assert f"corpus {tmp_path / 'nope.jsonl'} does not exist" in err
    assert "or the name of a bundled corpus: shakespeare" in err
    assert "Traceback" not in err


def test_cli_refuses_a_checkpoint_of_another_model_before_launch(tmp_path, monkeypatch, capsys):
    """`megatron-lite validate --config gpt_tiny.yaml --model.config.num_layers 2 --ckpt_path <a 4-layer checkpoint>`
    used to print "Restored all states" and score layers 0-1 alone (issue 21, item 1): now one line naming the
    entries and the config field that differ, and the switch, before any rank starts (the CLI's entry in this
    process, as for the missing corpus above; the ranks would be forked from it, not re-run pytest, were the refusal
    to come after the launch: the launching process checks the same way for every start method)."""
    from megatron_lite.pretrained import save_weights_checkpoint

    # the example config's model (vocab_size and seq_length come from its data section)
    config = ml.GPTConfig(
        num_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=352,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        vocab_size=2048,
        seq_length=128,
    )
    module = ml.GPTModule(config)
    module.model = module.build_model(ml.ParallelLayout.single())
    save_weights_checkpoint(module, tmp_path / "four_layers")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_code:
        cli.main(
            [
                "validate",
                "--config",
                str(REPO / "examples/configs/gpt_tiny.yaml"),
                "--model.config.num_layers",
                "2",
                "--ckpt_path",
                str(tmp_path / "four_layers"),
                "--trainer.default_root_dir",
                str(tmp_path / "run"),
                "--trainer.strategy.init_args.start_method",
                "fork",
                "--data.init_args.cache_dir",
                str(tmp_path / "cache"),
            ]
        )
    out, err = capsys.readouterr()
    assert exit_code.value.code == 2, err[-3000:]
    assert "megatron-lite: error: ckpt_path=" in err and "Traceback" not in err
    assert "unexpected 12 entries (model.layers.2.input_layernorm.weight, " in err
    assert "num_layers=4 (this module's: 2)" in err and "--model.strict_loading false" in err
    assert "Restored all states" not in out + err and not (tmp_path / "cache").exists()


def test_checkpoint_resume_gives_the_same_next_losses(tmp_path):
    """TP2 x DP... here TP2: save at step 3 through ModelCheckpoint (DCP), resume, compare steps 4-6."""
    full = run(tmp_path / "full", devices=2, tp=2, steps=6)
    ckpt_dir = tmp_path / "ckpts"
    run(
        tmp_path / "first",
        devices=2,
        tp=2,
        steps=3,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)],
    )
    saved = ckpt_dir / "epoch=0-step=3.ckpt"
    assert (saved / ".metadata").is_file() and (saved / "meta.json").is_file() and (saved / "manifest.json").is_file()
    assert not [p for p in ckpt_dir.iterdir() if ".tmp-" in p.name], "temporary checkpoint left behind"
    resumed = run(tmp_path / "resumed", devices=2, tp=2, steps=6, ckpt_path=str(saved))
    assert resumed["global_step"] == 6
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][3:]), rtol=1e-5, atol=0)


def test_logged_step_is_the_optimizer_step(tmp_path):
    logger = CSVLogger(tmp_path, name="csv")
    run(tmp_path / "r", devices=2, tp=2, steps=4, logger=logger, log_every_n_steps=1)
    import csv

    rows = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    assert {"train/lr", "train/grad_norm"} <= set(rows[0])


def test_under_torchrun(tmp_path):
    out = tmp_path / "result.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            str(REPO / "tests/integration/train_by_name.py"),
            str(out),
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["world_size"], result["dp"]) == (2, 2) and len(result["losses"]) == 3
    assert result["cluster"] == "TorchElasticEnvironment"


def test_two_torchrun_nodes_on_loopback_train_like_one_process(tmp_path):
    """Two "nodes" (a torchrun each, 2 processes, --nnodes 2 --node-rank, rendezvous on 127.0.0.1) and
    Trainer(num_nodes=2, devices=2) with TP2: tensor parallelism inside a node, data parallelism across the
    nodes, and the same losses, first-step gradients and final parameters as one process (fp32 tolerance)."""
    run_args = dict(devices=2, num_nodes=2, tp=2, steps=3)
    port = str(_free_port())
    nodes = [
        subprocess.Popen(
            [
                sys.executable,  # torchrun, its workers forked with Lightning imported
                str(REPO / "tests/integration/preloaded_torchrun.py"),
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                str(REPO / "tests/distributed/parity_utils.py"),
                str(tmp_path / "run"),
                json.dumps(run_args),
            ],
            cwd=tmp_path,
            env=dict(_env(), PYTHONPATH=str(REPO)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    reference = run(tmp_path / "reference", devices=1, steps=run_args["steps"])  # meanwhile, in this process
    for node in nodes:
        out, _ = node.communicate(timeout=300)
        assert node.returncode == 0, out[-3000:]
    layout = json.loads((tmp_path / "run" / "layout.json").read_text())
    assert [rank["node"] for rank in layout] == [0, 0, 1, 1]
    for rank in layout:
        assert {layout[r]["node"] for r in rank["tp"]} == {rank["node"]} and len(rank["tp"]) == 2  # TP in a node
        assert {layout[r]["node"] for r in rank["dp"]} == {0, 1} and len(rank["dp"]) == 2  # DP across nodes
    assert_same_training(torch.load(tmp_path / "run" / "result.pt", weights_only=False), reference)


def _slurm_task(script: Path, out: Path, env: dict) -> None:
    """One task of the allocation: the script as ``__main__`` in this forked process, with the task's environment
    (the interpreter and Lightning are already loaded: a fresh one per task costs ~5 s of CPU to import them, and
    how a task's process starts is srun's business, not what this test is about)."""
    code = 1
    try:
        os.environ.update(env)
        os.chdir(out.parent)
        sys.argv = [str(script), str(out)]
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def test_in_a_slurm_allocation(tmp_path):
    """Two tasks started the way `srun --ntasks=2` starts them (the SLURM variables of each task, nothing from a
    launcher); Lightning's SLURMEnvironment joins them."""
    out = tmp_path / "result.json"
    tasks, port = [], str(_free_port())
    for rank in range(2):
        env = dict(
            OMP_NUM_THREADS="1",
            SLURM_NTASKS="2",
            SLURM_NTASKS_PER_NODE="2",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NODEID="0",
            SLURM_JOB_ID="4242",
            MASTER_PORT=port,
            SLURM_JOB_NAME="train",
            SLURM_NODELIST="localhost",
        )
        task = multiprocessing.get_context("fork").Process(
            target=_slurm_task, args=(REPO / "tests/integration/train_by_name.py", out, env)
        )
        task.start()
        tasks.append(task)
    for task in tasks:
        task.join(timeout=300)
        assert task.exitcode == 0, f"a task ended with {task.exitcode} (its traceback is in the captured stderr)"
    result = json.loads(out.read_text())
    assert (result["world_size"], result["dp"]) == (2, 2) and len(result["losses"]) == 3
    assert result["cluster"] == "SLURMEnvironment"  # the tasks joined as the allocation's ranks, no launcher


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_validate_from_a_checkpoint_reproduces_the_val_loss(tmp_path):
    def trainer(**kw):
        return L.Trainer(
            strategy=ml.MegatronStrategy(tensor_model_parallel_size=2, start_method="fork"),
            accelerator="cpu",
            devices=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=2,
            **kw,
        )

    def data():
        return MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=8, vocab_size=1000, seed=7)

    fit = trainer(
        max_steps=3,
        val_check_interval=3,
        num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3)],
    )
    fit.fit(ml.GPTModule(tiny_config(), ml.OptimizerConfig(lr=1e-2)), data())
    val_during_fit = float(fit.callback_metrics["val/loss"])
    (result,) = trainer().validate(ml.GPTModule(tiny_config()), data(), ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"))
    fresh = trainer().validate(ml.GPTModule(tiny_config()), data())[0]["val/loss"]
    assert result["val/loss"] == pytest.approx(val_during_fit, rel=1e-6)
    assert abs(fresh - val_during_fit) > 1e-3  # the checkpoint's weights were really loaded


def test_test_and_predict(tmp_path):
    """trainer.test logs test/loss under TP2; predict returns full-vocabulary logits (single process,
    since Lightning cannot return predictions from forked ranks)."""
    data = MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=8, vocab_size=1000, seed=7)
    data.test_dataloader = data.val_dataloader  # the mock data's validation split doubles as a test split
    tester = L.Trainer(
        strategy="megatron_fork",
        accelerator="cpu",
        devices=2,
        logger=False,
        limit_test_batches=2,
        enable_progress_bar=False,
    )
    (result,) = tester.test(ml.GPTModule(tiny_config()), data)
    assert 6.5 < result["test/loss"] < 7.2  # ~ln(1000) for a fresh model

    module = ml.GPTModule(tiny_config())
    predictor = L.Trainer(
        accelerator="cpu", devices=1, logger=False, limit_predict_batches=1, enable_progress_bar=False
    )
    tokens = torch.randint(0, 1000, (3, 32))
    (logits,) = predictor.predict(module, torch.utils.data.DataLoader([{"tokens": t} for t in tokens], batch_size=3))
    assert logits.shape == (3, 32, 1000)
    torch.testing.assert_close(logits, module.model(tokens)[..., :1000])


def test_resume_with_dropout_is_exact(tmp_path):
    """With dropout on, a resumed TP2 run draws the same masks as the uninterrupted one: each rank's
    dropout streams (different per TP rank) are saved in the checkpoint and restored."""
    config = tiny_config(hidden_dropout=0.2, attention_dropout=0.2)
    full = run(tmp_path / "full", devices=2, tp=2, steps=6, config=config)
    ckpt_dir = tmp_path / "ckpts"
    run(
        tmp_path / "first",
        devices=2,
        tp=2,
        steps=3,
        config=config,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)],
    )
    resumed = run(
        tmp_path / "resumed", devices=2, tp=2, steps=6, config=config, ckpt_path=str(ckpt_dir / "epoch=0-step=3.ckpt")
    )
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][3:]), rtol=1e-5, atol=0)
