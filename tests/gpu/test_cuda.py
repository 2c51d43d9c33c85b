"""GPU paths: CUDA model building, dropout streams on CUDA, NCCL tensor parallelism.

Skipped where there is no NVIDIA GPU (our CI machines); run them on a GPU machine with
`pytest tests/gpu`. TF32 is switched off so results compare with the fp32 CPU reference.
"""

import sys
from pathlib import Path

import pytest
import torch

import megatron_lite as ml
from megatron_lite.core.parallel.random import DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG, model_parallel_rng_tracker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from parity_utils import assert_same_training, run, tiny_config  # noqa: E402

NO_CUDA = "needs CUDA: no NVIDIA GPU visible on this machine"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]


@pytest.fixture(autouse=True)
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def test_model_built_under_a_cuda_default_device_has_the_cpu_weights():
    config = tiny_config()
    cpu = ml.GPTModel(config, seed=5)
    with torch.device("cuda"):  # what Lightning does around configure_model
        gpu = ml.GPTModel(config, seed=5)
    for (name, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters()):
        assert b.is_cuda
        torch.testing.assert_close(b.cpu(), a, rtol=0, atol=0, msg=name)


def test_dropout_streams_drive_cuda_dropout_and_restore_the_global_generator():
    tracker = model_parallel_rng_tracker(seed=3, tp_rank=0)
    x = torch.ones(4096, device="cuda")
    before = torch.cuda.get_rng_state()
    with tracker.fork(MODEL_PARALLEL_RNG, x.device):
        a = torch.nn.functional.dropout(x, 0.5)
    with tracker.fork(DATA_PARALLEL_RNG, x.device):
        b = torch.nn.functional.dropout(x, 0.5)
    assert torch.equal(torch.cuda.get_rng_state(), before)
    assert not torch.equal(a, b)
    again = model_parallel_rng_tracker(seed=3, tp_rank=0)
    with again.fork(MODEL_PARALLEL_RNG, x.device):
        assert torch.equal(torch.nn.functional.dropout(x, 0.5), a)


def test_one_gpu_matches_the_cpu_run(tmp_path):
    # spawn: a forked child cannot use CUDA once this process has initialised it
    cpu = run(tmp_path / "cpu", devices=1, steps=5, start_method="spawn")
    gpu = run(tmp_path / "gpu", devices=1, steps=5, accelerator="gpu", start_method="spawn")
    assert_same_training(gpu, cpu, rtol=1e-4)


def test_bf16_mixed_on_one_gpu_trains(tmp_path):
    result = run(tmp_path, devices=1, steps=10, accelerator="gpu", start_method="spawn", precision="bf16-mixed")
    losses = torch.tensor(result["losses"])
    assert torch.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for NCCL tensor parallelism")
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_tp2_over_nccl_matches_one_gpu(tmp_path, sp):
    reference = run(tmp_path / "one", devices=1, steps=5, accelerator="gpu", start_method="spawn")
    result = run(tmp_path / "two", devices=2, tp=2, sp=sp, steps=5, accelerator="gpu", start_method="spawn")
    assert_same_training(result, reference, rtol=1e-4)


def _optimizer(**kwargs):
    settings = dict(lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4, clip_grad=0.5)
    settings.update(kwargs)
    return ml.OptimizerConfig(**settings)


def test_distributed_optimizer_and_fsdp2_on_one_gpu_match_plain(tmp_path):
    plain = run(tmp_path / "plain", devices=1, steps=5, accelerator="gpu", start_method="spawn", optimizer=_optimizer())
    zero1 = run(
        tmp_path / "zero1",
        devices=1,
        steps=5,
        accelerator="gpu",
        start_method="spawn",
        optimizer=_optimizer(use_distributed_optimizer=True),
    )
    assert_same_training(zero1, plain, rtol=1e-5, grads=False)
    fsdp = run(
        tmp_path / "fsdp",
        devices=1,
        steps=5,
        accelerator="gpu",
        start_method="spawn",
        optimizer=_optimizer(),
        strategy_kwargs=dict(use_torch_fsdp2=True),
    )
    assert_same_training(fsdp, plain, rtol=1e-5)


def test_fp16_mixed_on_gpu_scales_the_loss_and_trains(tmp_path):
    """Megatron's default scale 2**32 overflows fp16 at first: those steps are skipped, then it trains."""
    result = run(
        tmp_path,
        devices=1,
        steps=40,
        accelerator="gpu",
        start_method="spawn",
        precision="16-mixed",
        optimizer=_optimizer(lr_decay_style="constant", lr_decay_iters=None),
    )
    assert 0 < result["skipped_steps"] < 40
    assert result["loss_scale"] < 2.0**32
    losses = torch.tensor(result["losses"])
    assert torch.isfinite(losses[-10:]).all() and losses[-1] < losses[0]


def test_bf16_true_on_gpu_tracks_fp32(tmp_path):
    fp32 = run(tmp_path / "fp32", devices=1, steps=8, accelerator="gpu", start_method="spawn", optimizer=_optimizer())
    bf16 = run(
        tmp_path / "bf16",
        devices=1,
        steps=8,
        accelerator="gpu",
        start_method="spawn",
        optimizer=_optimizer(),
        precision="bf16-true",
    )
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(fp32["losses"]), rtol=2e-2, atol=0)


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="selective"),
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ],
    ids=["selective", "full"],
)
def test_recompute_on_gpu_gives_the_same_gradients(recompute):
    config = tiny_config(hidden_dropout=0.1, attention_dropout=0.1)
    tokens = torch.randint(
        0,
        config.vocab_size,
        (2, config.seq_length + 1),
        device="cuda",
        generator=torch.Generator(device="cuda").manual_seed(0),
    )
    grads = []
    for cfg in (config, tiny_config(hidden_dropout=0.1, attention_dropout=0.1, **recompute)):
        with torch.device("cuda"):
            model = ml.GPTModel(cfg, seed=3).train()
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_metrics_on_gpu_log_mfu_against_the_data_sheet_and_energy(tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    # big enough that an interval of steps lasts long enough for NVML's energy counter to tick
    config = tiny_config(
        num_layers=8,
        hidden_size=1024,
        num_attention_heads=16,
        num_query_groups=8,
        seq_length=1024,
        vocab_size=32000,
        make_vocab_size_divisible_by=128,
    )
    run(
        tmp_path,
        devices=1,
        steps=30,
        gbs=32,
        mbs=8,
        config=config,
        accelerator="gpu",
        start_method="spawn",
        precision="bf16-mixed",
        logger=CSVLogger(tmp_path, name="csv"),
        log_every_n_steps=10,
    )
    rows = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("train/mfu")]
    assert rows, "no MFU logged"
    for row in rows:
        assert 0 < float(row["train/mfu"]) < 1
        assert float(row["train/energy_per_step_j"]) > 0  # NVML's energy counter moved during the steps
        assert float(row["train/mem_peak_gib"]) > 0
