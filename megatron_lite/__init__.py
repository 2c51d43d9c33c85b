"""megatron-lite: Megatron-LM's training stack as a Lightning-native library.

``import megatron_lite`` registers the ``"megatron"`` strategy, so ``Trainer(strategy="megatron")`` works.
"""
from megatron_lite.core.models import GPTConfig, GPTModel
from megatron_lite.core.optim import OptimizerConfig
from megatron_lite.core.parallel import ParallelConfig, ParallelLayout
from megatron_lite.module import GPTModule
from megatron_lite.strategies import MegatronStrategy, register_megatron_strategy

register_megatron_strategy()

__version__ = "0.1.0"
__all__ = ["GPTConfig", "GPTModel", "GPTModule", "MegatronStrategy", "OptimizerConfig", "ParallelConfig",
           "ParallelLayout", "__version__"]
