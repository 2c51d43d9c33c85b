"""DeepSeek-V3 interop against transformers itself: tiny random ``DeepseekV3ForCausalLM`` models (a dense first layer,
8 routed experts in 4 groups with sigmoid scores, a non-zero ``e_score_correction_bias``, two shared experts, the
routed scaling factor) with query compression, YaRN (mscale != mscale_all_dim) and DeepSeek's interleaved RoPE
layout, or without query compression, plain RoPE and the non-interleaved layout. Imported in one process, their
logits are transformers' (fp32, relative L2 error 1e-5) and greedy generation through our latent KV cache gives
transformers' tokens; converted to our checkpoint and back with the CLI, the
export loads in transformers with the same logits. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[dev]'): these tests build DeepSeek-V3"
)
transformers.utils.logging.disable_progress_bar()

from test_hf_interop import VOCAB, _assert_close, _convert, _hf_logits  # noqa: E402  (the Llama interop test's)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from mla_utils import DEEPSEEK_V3_TINY  # noqa: E402

import megatron_lite as ml  # noqa: E402
from megatron_lite.pretrained import save_weights_checkpoint  # noqa: E402

SHAPE = dict(DEEPSEEK_V3_TINY, vocab_size=VOCAB)
CASES = {
    "q_lora_yarn_interleaved": dict(
        q_lora_rank=24,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 0.8,
            "mscale_all_dim": 1.0,
        },
    ),
    "no_q_lora_plain_rope": dict(
        q_lora_rank=None, rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}
    ),
}


def _random_deepseek(case: str, seed: int):
    """A transformers DeepSeek-V3 of ``case`` with every parameter drawn, and the expert-choice bias too."""
    model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**SHAPE, **CASES[case]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts are chosen
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_v3_import_gives_transformers_logits_and_exports_back(case, tmp_path):
    seed = list(CASES).index(case)
    model = _random_deepseek(case, seed)
    model.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))
    reference = _hf_logits(model, tokens)
    module = ml.GPTModule.from_pretrained(tmp_path / "hf")
    assert module.config.multi_latent_attention and module.config.moe_router_enable_expert_bias
    _assert_close(module.full_logits(tokens), reference)
    # greedy generation through the latent cache continues the prompt as transformers does
    prompt = tokens[:1, :8]
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert module.generate(prompt.tolist(), max_new_tokens=6).tokens == expected[:, 8:].tolist()

    _convert("--from", "hf", "--input", tmp_path / "hf", "--output", tmp_path / "ckpt")
    _convert("--to", "hf", "--input", tmp_path / "ckpt", "--output", tmp_path / "exported")
    written = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3" and written["rope_interleave"] is True
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert type(loaded) is type(model)
    _assert_close(_hf_logits(loaded, tokens), reference)


MLA_PROJECTIONS = {
    "q_lora_yarn_interleaved": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "no_q_lora_plain_rope": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_v3_peft_adapter_imports_with_peft_logits_and_exports_back(case, tmp_path):
    """A PEFT LoRA adapter on every MLA projection (random non-zero A and B) gives PEFT's logits on our imported
    model (the rotated rows of ``lora_B`` permuted as the weights', on the interleaved base; as they are on the
    other) and, exported with ``--to hf-peft``, loads in PEFT with them on the base as ``--to hf`` writes it
    (DeepSeek's interleaved layout)."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[dev]')")
    model = _random_deepseek(case, list(CASES).index(case))
    model.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))
    base_logits = _hf_logits(model, tokens)
    lora = peft.LoraConfig(r=4, lora_alpha=16, target_modules=MLA_PROJECTIONS[case])
    adapted = peft.get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    adapted.save_pretrained(tmp_path / "peft")
    expected = _hf_logits(adapted.eval(), tokens)
    assert float((expected - base_logits).norm() / base_logits.norm()) > 1e-2  # the adapter changes the logits

    module = ml.GPTModule.from_pretrained(tmp_path / "hf", adapter=tmp_path / "peft")
    _assert_close(module.full_logits(tokens), expected)

    save_weights_checkpoint(module, tmp_path / "ckpt", hf_source=tmp_path / "hf")
    _convert("--to", "hf-peft", "--input", tmp_path / "ckpt", "--output", tmp_path / "back")
    base = tmp_path / "hf"
    if not CASES[case]["rope_interleave"]:  # the export's rows are DeepSeek's interleaved ones: so is its base
        _convert("--from", "hf", "--input", tmp_path / "hf", "--output", tmp_path / "base_ckpt")
        _convert("--to", "hf", "--input", tmp_path / "base_ckpt", "--output", base := tmp_path / "base")
    back = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "back")
    _assert_close(_hf_logits(back.eval(), tokens), expected)
