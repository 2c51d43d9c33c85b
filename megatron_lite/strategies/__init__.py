"""Lightning strategies."""
from megatron_lite.strategies.megatron import MegatronStrategy, register_megatron_strategy

__all__ = ["MegatronStrategy", "register_megatron_strategy"]
