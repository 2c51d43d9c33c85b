"""Text generation with the core GPT model: a static KV cache, batched prompts of any lengths, greedy /
temperature / top-k / top-p sampling with seeded generators, log-probs, stop ids, under TP and PP."""

from megatron_lite.core.inference.generate import GenerationResult, generate, generation_mode, model_context
from megatron_lite.core.inference.kv_cache import InferenceStep, KVCache
from megatron_lite.core.inference.sampling import SamplingParams, TokenSampler, token_log_probs

__all__ = [
    "GenerationResult",
    "InferenceStep",
    "KVCache",
    "SamplingParams",
    "TokenSampler",
    "generate",
    "generation_mode",
    "model_context",
    "token_log_probs",
]
