"""The strategy by name, the CLI with the example config, and checkpoint save/resume, end to end."""
import json
import os
import subprocess
import sys
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
    proc = subprocess.run([sys.executable, str(REPO / "tests/integration/train_by_name.py"), str(out)],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["strategy"] == "MegatronStrategy"
    assert (result["world_size"], result["dp"], result["tp"]) == (2, 2, 1)
    assert len(result["losses"]) == 3 and all(5.0 < x < 6.0 for x in result["losses"])  # ~ln(256)


def test_fork_name_resolves():
    trainer = L.Trainer(strategy="megatron_fork", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ml.MegatronStrategy)
    assert trainer.strategy._start_method == "fork"


def test_cli_fit_with_example_config_from_another_directory(tmp_path):
    """The example config as written (its corpus named `path: shakespeare`), run from a directory that is not
    the checkout: the bundled corpus resolves inside the package, not relative to the working directory."""
    work = tmp_path / "elsewhere"
    work.mkdir()
    cmd = [sys.executable, "-m", "megatron_lite", "fit", "--config", str(REPO / "examples/configs/gpt_tiny.yaml"),
           "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
           "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(tmp_path / "run"),
           "--trainer.enable_progress_bar", "false", "--model.optimizer.lr_warmup_iters", "1",
           "--data.init_args.cache_dir", str(tmp_path / "cache"), "--data.init_args.vocab_size", "512"]
    proc = subprocess.run(cmd, cwd=work, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=4` reached." in proc.stderr + proc.stdout
    config = next((tmp_path / "run").rglob("config.yaml")).read_text()
    assert "path: shakespeare" in config
    assert "tensor_model_parallel_size: 2" in config
    assert "vocab_size: 512" in config  # linked from the data into the model
    events = list((tmp_path / "run").rglob("events.out.tfevents*"))
    assert events, "the default TensorBoard logger wrote nothing"


def test_cli_reports_missing_corpus_before_training(tmp_path, monkeypatch, capsys):
    """One line, no traceback (the CLI's entry in this process: the error comes before any launch)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_code:
        cli.main(["fit", "--config", str(REPO / "examples/configs/gpt_tiny.yaml"),
                  "--data.init_args.path", str(tmp_path / "nope.jsonl")])
    err = capsys.readouterr().err
    assert exit_code.value.code != 0
    assert f"corpus {tmp_path / 'nope.jsonl'} does not exist" in err
    assert "or the name of a bundled corpus: shakespeare" in err
    assert "Traceback" not in err


def test_checkpoint_resume_gives_the_same_next_losses(tmp_path):
    """TP2 x DP... here TP2: save at step 3 through ModelCheckpoint (DCP), resume, compare steps 4-6."""
    full = run(tmp_path / "full", devices=2, tp=2, steps=6)
    ckpt_dir = tmp_path / "ckpts"
    run(tmp_path / "first", devices=2, tp=2, steps=3,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)])
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
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(_free_port()),
                           str(REPO / "tests/integration/train_by_name.py"), str(out)],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["world_size"], result["dp"]) == (2, 2) and len(result["losses"]) == 3


def test_two_torchrun_nodes_on_loopback_train_like_one_process(tmp_path):
    """Two "nodes" (a torchrun each, 2 processes, --nnodes 2 --node-rank, rendezvous on 127.0.0.1) and
    Trainer(num_nodes=2, devices=2) with TP2: tensor parallelism inside a node, data parallelism across the
    nodes, and the same losses, first-step gradients and final parameters as one process (fp32 tolerance)."""
    run_args = dict(devices=2, num_nodes=2, tp=2, steps=3)
    torchrun, port = Path(sys.executable).with_name("torchrun"), str(_free_port())
    nodes = [subprocess.Popen([str(torchrun), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                               "--master-addr", "127.0.0.1", "--master-port", port,
                               str(REPO / "tests/distributed/parity_utils.py"), str(tmp_path / "run"),
                               json.dumps(run_args)],
                              cwd=tmp_path, env=dict(_env(), PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for node in range(2)]
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


def test_in_a_slurm_allocation(tmp_path):
    """Two tasks started the way `srun --ntasks=2` starts them; Lightning's SLURMEnvironment joins them."""
    out = tmp_path / "result.json"
    procs, port = [], str(_free_port())
    for rank in range(2):
        env = dict(_env(), SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_PROCID=str(rank),
                   SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_JOB_ID="4242", MASTER_PORT=port,
                   SLURM_JOB_NAME="train", SLURM_NODELIST="localhost")
        procs.append(subprocess.Popen([sys.executable, str(REPO / "tests/integration/train_by_name.py"), str(out)],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    result = json.loads(out.read_text())
    assert (result["world_size"], result["dp"]) == (2, 2) and len(result["losses"]) == 3


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_validate_from_a_checkpoint_reproduces_the_val_loss(tmp_path):
    def trainer(**kw):
        return L.Trainer(strategy=ml.MegatronStrategy(tensor_model_parallel_size=2, start_method="fork"),
                         accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=2, **kw)

    def data():
        return MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=8, vocab_size=1000, seed=7)

    fit = trainer(max_steps=3, val_check_interval=3, num_sanity_val_steps=0,
                  callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3)])
    fit.fit(ml.GPTModule(tiny_config(), ml.OptimizerConfig(lr=1e-2)), data())
    val_during_fit = float(fit.callback_metrics["val/loss"])
    (result,) = trainer().validate(ml.GPTModule(tiny_config()), data(), ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"))
    fresh = trainer().validate(ml.GPTModule(tiny_config()), data())[0]["val/loss"]
    assert result["val/loss"] == pytest.approx(val_during_fit, rel=1e-6)
    assert abs(fresh - val_during_fit) > 1e-3  # the checkpoint's weights were really loaded


def test_cli_preprocess_then_fit_on_bin_idx(tmp_path, capsys):
    """The README's two-step pipeline: `megatron-lite preprocess` to .bin/.idx, then `fit` on it (TP2 + SP).
    preprocess through the CLI's entry in this process (its 2 workers forked from it; test_preprocess.py runs
    its own entry as a process), fit as a process of its own."""
    gpt2 = REPO / "tests" / "data" / "tokenizers" / "gpt2"
    prefix = tmp_path / "data" / "shakespeare"
    with pytest.raises(SystemExit) as pre:
        cli.main(["preprocess", "--input", str(REPO / "megatron_lite/data/corpora/shakespeare.jsonl.gz"),
                  "--output-prefix", str(prefix), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                  str(gpt2 / "vocab.json"), "--merge-file", str(gpt2 / "merges.txt"), "--workers", "2", "--append-eod",
                  "--no-progress"])
    assert pre.value.code == 0, capsys.readouterr().err[-3000:]
    assert (tmp_path / "data" / "shakespeare_text_document.idx").is_file()
    fit = subprocess.run([sys.executable, "-m", "megatron_lite", "fit", "--config",
                          str(REPO / "examples/configs/gpt_pretrain_bin.yaml"),
                          f"--data.init_args.paths=[{prefix}_text_document]",
                          "--data.init_args.tokenizer.init_args.vocab_file", str(gpt2 / "vocab.json"),
                          "--data.init_args.tokenizer.init_args.merge_file", str(gpt2 / "merges.txt"),
                          "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0",
                          "--model.optimizer.lr_warmup_iters", "1", "--trainer.enable_progress_bar", "false",
                          "--trainer.default_root_dir", str(tmp_path / "run"),
                          # 4 sequences of 32 tokens a step, not 16 of 128 (GPT-2's 50257 logits per token)
                          "--data.init_args.seq_length", "32", "--data.init_args.micro_batch_size", "2",
                          "--data.init_args.global_batch_size", "4"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in fit.stderr + fit.stdout
    config = next((tmp_path / "run").rglob("config.yaml")).read_text()
    assert "sequence_parallel: true" in config
    hparams = next((tmp_path / "run").rglob("hparams.yaml")).read_text()
    assert "  vocab_size: 50257" in hparams  # the model took its vocabulary from the data's tokenizer


def test_test_and_predict(tmp_path):
    """trainer.test logs test/loss under TP2; predict returns full-vocabulary logits (single process,
    since Lightning cannot return predictions from forked ranks)."""
    data = MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=8, vocab_size=1000, seed=7)
    data.test_dataloader = data.val_dataloader  # the mock data's validation split doubles as a test split
    tester = L.Trainer(strategy="megatron_fork", accelerator="cpu", devices=2, logger=False, limit_test_batches=2,
                       enable_progress_bar=False)
    (result,) = tester.test(ml.GPTModule(tiny_config()), data)
    assert 6.5 < result["test/loss"] < 7.2  # ~ln(1000) for a fresh model

    module = ml.GPTModule(tiny_config())
    predictor = L.Trainer(accelerator="cpu", devices=1, logger=False, limit_predict_batches=1, enable_progress_bar=False)
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
    run(tmp_path / "first", devices=2, tp=2, steps=3, config=config,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)])
    resumed = run(tmp_path / "resumed", devices=2, tp=2, steps=6, config=config,
                  ckpt_path=str(ckpt_dir / "epoch=0-step=3.ckpt"))
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][3:]), rtol=1e-5, atol=0)


def test_cli_loggers_then_plot_and_estimate(tmp_path, capsys):
    """TensorBoard + CSV + offline W&B configured from YAML, Megatron's metrics in them, then `plot` and
    `estimate` on the same config."""
    import yaml

    run_dir = tmp_path / "runs"
    loggers = yaml.safe_load((REPO / "examples/configs/loggers.yaml").read_text())  # the example, saving here
    for logger in loggers["trainer"]["logger"]:
        logger["init_args"]["save_dir"] = str(run_dir)
    (tmp_path / "loggers.yaml").write_text(yaml.safe_dump(loggers))
    cmd = [sys.executable, "-m", "megatron_lite", "fit", "--config", str(REPO / "examples/configs/gpt_tiny.yaml"),
           "--config", str(tmp_path / "loggers.yaml"),
           "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
           "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(run_dir),
           "--trainer.enable_progress_bar", "false", "--model.optimizer.lr_warmup_iters", "1",
           "--data.init_args.cache_dir", str(tmp_path / "cache"), "--data.init_args.vocab_size", "512"]
    env = dict(_env(), WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((run_dir / "tb").rglob("events.out.tfevents*"))
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    import csv

    rows = list(csv.DictReader(open(next((run_dir / "csv").rglob("metrics.csv")))))
    steps = sorted({int(r["step"]) for r in rows if r.get("train/tokens_per_sec")})
    assert steps and steps == sorted(set(steps)) and max(steps) <= 3  # optimizer steps, once each
    assert any(r.get("val/perplexity") for r in rows)
    # the tools through the CLI's entry in this process: the fit above ran `python -m megatron_lite` as a process
    # (test_estimate_cli.py runs estimate's own entry as one, test_bare_install.py the `megatron-lite` script)
    png = tmp_path / "curves.png"
    capsys.readouterr()
    with pytest.raises(SystemExit) as plot:
        cli.main(["plot", str(run_dir), "--out", str(png)])
    assert plot.value.code == 0, capsys.readouterr().err[-2000:]
    assert png.stat().st_size > 10_000
    capsys.readouterr()
    with pytest.raises(SystemExit) as estimate:
        cli.main(["estimate", "--config", str(REPO / "examples/configs/gpt_tiny.yaml"), "--json"])
    out = capsys.readouterr()
    assert estimate.value.code == 0, out.err[-2000:]
    assert json.loads(out.out)["flops_per_step"] > 0
