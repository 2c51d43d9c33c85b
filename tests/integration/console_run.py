"""A user script that trains with Lightning's progress bar on the console: the demo's strategy
(``MegatronStrategy(tensor_model_parallel_size=2)`` at devices=2) on a tiny GPT, with a validation
in the middle of the epoch. ``test_console.py`` runs it with stdout and stderr into one pipe, as a
terminal shows them.

    python console_run.py '{"start_method": "popen", "max_steps": 12, "log_every_n_steps": 1, "metrics": null}'
    python console_run.py '[{"start_method": "fork", ...}, {"start_method": "fork", ...}]'   # fit after fit

``metrics``: None for the MegatronMetrics callback the strategy adds by default, else the keyword
arguments of one passed to the Trainer. With ``start_method="popen"`` (the demo's default launcher)
rank 1 re-runs this script with the same arguments. A list of settings runs one fit after the other in
this process, as a notebook does, with a line SEPARATOR between their consoles (one interpreter start for
them all: ~6 s of CPU apiece).
"""

import json
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

import megatron_lite as ml
from megatron_lite.callbacks import MegatronMetrics
from megatron_lite.data import MockGPTDataModule

SEPARATOR = "=" * 20 + " next fit " + "=" * 20


def fit(settings: dict) -> None:
    # Lightning's default bar is Rich's whenever rich is installed (transformers brings it in): this
    # script checks the layout around the TQDM bar, so it names it
    callbacks = [TQDMProgressBar()] + ([] if settings["metrics"] is None else [MegatronMetrics(**settings["metrics"])])
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=2, start_method=settings["start_method"]),
        accelerator="cpu",
        devices=2,
        max_steps=settings["max_steps"],
        log_every_n_steps=settings["log_every_n_steps"],
        val_check_interval=settings["max_steps"] // 2,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    config = ml.GPTConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=256, seq_length=32
    )
    data = MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=4, vocab_size=256)
    trainer.fit(ml.GPTModule(config, ml.OptimizerConfig(lr=1e-3, lr_warmup_iters=2)), data)


if __name__ == "__main__":
    torch.set_num_threads(1)
    runs = json.loads(sys.argv[1])
    for i, settings in enumerate(runs if isinstance(runs, list) else [runs]):
        if i:
            sys.stderr.flush()
            print(SEPARATOR, flush=True)
        fit(settings)
