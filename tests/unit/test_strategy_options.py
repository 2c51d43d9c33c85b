"""MegatronStrategy's options: every constructor argument lands in its StrategyOptions, and each is documented where
``megatron-lite fit --help`` reads it (the docstring's Args, parsed by jsonargparse)."""

import dataclasses
import inspect

import pytest
from jsonargparse import ArgumentParser

import megatron_lite as ml
from megatron_lite.core.parallel.layout import ParallelConfig
from megatron_lite.strategies.options import StrategyOptions

# Lightning's plugins: taken by the strategy's base class, not options of ours.
LIGHTNING_ARGUMENTS = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}


def _own_arguments() -> list[str]:
    names = inspect.signature(ml.MegatronStrategy.__init__).parameters
    return [name for name in names if name != "self" and name not in LIGHTNING_ARGUMENTS]


def test_every_argument_is_kept_in_the_options_with_its_value():
    parallel = {f.name for f in dataclasses.fields(ParallelConfig)}
    options = {f.name for f in dataclasses.fields(StrategyOptions)} - {"parallel"}
    assert set(_own_arguments()) <= parallel | options
    assert options <= set(_own_arguments())  # no option without its argument
    given = dict(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        cp_comm_type="all_gather",
        ddp_bucket_size=1000,
        async_save=True,
        check_memory=False,
        start_method="fork",
    )
    strategy = ml.MegatronStrategy(**given)
    for name, value in given.items():
        held = strategy.options.parallel if name in parallel else strategy.options
        assert getattr(held, name) == value, name
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.options.async_save = False


def test_every_argument_has_its_help_text():
    parser = ArgumentParser()
    parser.add_class_arguments(ml.MegatronStrategy, "strategy")
    helps = {action.dest.removeprefix("strategy."): action.help for action in parser._actions}
    undocumented = [name for name in _own_arguments() if not (helps.get(name) or "").strip()]
    assert not undocumented
