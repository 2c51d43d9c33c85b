"""Lightning strategies."""

from megatron_lite.strategies.megatron import MegatronStrategy, register_megatron_strategy
from megatron_lite.strategies.options import StrategyOptions
from megatron_lite.strategies.pre_launch import PreLaunchCheck

__all__ = ["MegatronStrategy", "PreLaunchCheck", "StrategyOptions", "register_megatron_strategy"]
