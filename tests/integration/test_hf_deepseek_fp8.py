"""DeepSeek-V3's FP8 hub format (block-scaled e4m3 weights with ``_scale_inv`` companions, dequantized on import)
against transformers itself. A tiny random ``DeepseekV3ForCausalLM`` (the DeepSeek interop test's, with query
compression and interleaved RoPE) has its linear weights quantized by :func:`_quantize`, written here from the
format's definition (one float32 scale per block, amax / 448; the edge blocks partial), and saved with DeepSeek's
``quantization_config``. Imported, its logits are those of transformers loading the same directory with
``FineGrainedFP8Config(dequantize=True)`` (8x8 blocks, which divide every tiny width: transformers' loader derives
the block from the scale grid, which is wrong for partial edge blocks), and, with 16x24 blocks that leave partial
blocks on both edges, those of transformers on the weights dequantized by transformers' own
``_dequantize_fp8_weight``. The dequantized weights are ``fp8.float() * scale`` exactly; ``convert`` turns the FP8
directory into a bf16 one transformers loads; bad inputs are refused by name before a weight is read."""

from __future__ import annotations

import json
import math
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: these tests build DeepSeek-V3"
)
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (comes with it)")

from test_hf_deepseek import _random_deepseek  # noqa: E402
from test_hf_interop import VOCAB, _assert_close, _convert, _hf_logits  # noqa: E402

import megatron_lite as ml  # noqa: E402
from megatron_lite.core.checkpoint.errors import UnsupportedHFModel  # noqa: E402
from megatron_lite.core.checkpoint.hf.directory import read_hf_tensors  # noqa: E402

CASE = "q_lora_yarn_interleaved"  # 24-wide query latent and RoPE-key rows: partial blocks for 16x24
FP8_MAX = 448.0  # the largest float8_e4m3fn
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))


def _quantization(block: list[int]) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block}


def _blocks(weight: torch.Tensor, block: list[int]) -> torch.Tensor:
    """``weight`` zero-padded to whole blocks, viewed [block rows, r, block columns, c]."""
    (rows, cols), (r, c) = weight.shape, block
    padded = torch.zeros(math.ceil(rows / r) * r, math.ceil(cols / c) * c)
    padded[:rows, :cols] = weight
    return padded.reshape(padded.shape[0] // r, r, padded.shape[1] // c, c)


def _quantize(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv) of ``weight``: each block divided by its amax / 448."""
    blocks = _blocks(weight.float(), block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    quantized = (blocks / scale[:, None, :, None]).flatten(0, 1).flatten(1)[: weight.shape[0], : weight.shape[1]]
    return quantized.to(torch.float8_e4m3fn), scale


def _dequantize(quantized: torch.Tensor, scale: torch.Tensor, block: list[int]) -> torch.Tensor:
    """The format's definition: each fp8 value times its block's scale, in float32."""
    weight = (_blocks(quantized.float(), block) * scale[:, None, :, None]).flatten(0, 1).flatten(1)
    return weight[: quantized.shape[0], : quantized.shape[1]]


def _fp8_directory(model, block: list[int], path) -> tuple[dict, dict]:
    """``model`` saved in DeepSeek's FP8 format under ``path``: (its unquantized tensors, the saved FP8 tensors)."""
    model.save_pretrained(path / "plain")
    plain = safetensors_torch.load_file(path / "plain" / "model.safetensors")
    saved = {}
    for name, tensor in plain.items():
        if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):  # the linears DeepSeek quantizes
            saved[name], saved[name + "_scale_inv"] = _quantize(tensor, block)
        else:  # norms, embedding, router, lm_head
            saved[name] = tensor
    (path / "fp8").mkdir()
    safetensors_torch.save_file(saved, path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "plain" / "config.json").read_text())
    (path / "fp8" / "config.json").write_text(json.dumps({**config, "quantization_config": _quantization(block)}))
    return plain, saved


def test_fp8_import_gives_transformers_dequantized_logits(tmp_path):
    block = [8, 8]
    _fp8_directory(_random_deepseek(CASE, 0), block, tmp_path)
    fp8 = transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=block)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", quantization_config=fp8).eval()
    assert not any(p.dtype == torch.float8_e4m3fn for p in theirs.parameters())  # transformers dequantized it
    module = ml.GPTModule.from_pretrained(tmp_path / "fp8")
    _assert_close(module.full_logits(TOKENS), _hf_logits(theirs, TOKENS))


@pytest.fixture(scope="module")
def edge_blocks(tmp_path_factory):
    """A tiny DeepSeek-V3 in 16x24 FP8 blocks (partial blocks on both edges): (directory, plain and saved
    tensors, the model of the weights transformers dequantizes)."""
    block, path = [16, 24], tmp_path_factory.mktemp("fp8")
    plain, saved = _fp8_directory(_random_deepseek(CASE, 1), block, path)
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    dequantized = {
        name: _dequantize_fp8_weight(saved[name], saved[name + "_scale_inv"], block, torch.float32)
        if name + "_scale_inv" in saved
        else tensor
        for name, tensor in plain.items()
    }
    (path / "theirs").mkdir()
    safetensors_torch.save_file(dequantized, path / "theirs" / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(path / "plain" / "config.json", path / "theirs" / "config.json")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path / "theirs").eval()
    return path, block, plain, saved, reference


def test_fp8_edge_blocks_dequantize_exactly_and_convert_to_a_bf16_directory(edge_blocks):
    path, block, plain, saved, reference = edge_blocks
    read = read_hf_tensors(path / "fp8")
    assert set(read) == set(plain)  # the scales are not weights
    quantized = [name for name in plain if name + "_scale_inv" in saved]
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in quantized  # 24 rows: 1.5 blocks
    for name in quantized:
        assert read[name].dtype == torch.float32  # the config's dtype
        assert torch.equal(read[name], _dequantize(saved[name], saved[name + "_scale_inv"], block)), name
    assert all(torch.equal(read[name], plain[name]) for name in plain if name not in quantized)

    module = ml.GPTModule.from_pretrained(path / "fp8")
    _assert_close(module.full_logits(TOKENS), _hf_logits(reference, TOKENS))

    _convert("--from", "hf", "--input", path / "fp8", "--output", path / "ckpt")
    _convert("--to", "hf", "--input", path / "ckpt", "--output", path / "bf16", "--dtype", "bfloat16")
    written = json.loads((path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in written and written["torch_dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path / "bf16").eval()
    assert type(loaded) is type(reference) and loaded.dtype == torch.bfloat16
    expected = {name: t.to(torch.bfloat16) for name, t in reference.state_dict().items()}
    exported = loaded.state_dict()  # the weights our import dequantized, in bf16: transformers' own, cast
    assert exported.keys() == expected.keys()
    assert all(torch.equal(t, expected[name]) for name, t in exported.items())


def _variant(edge_blocks, tmp_path, quantization=None, drop=(), replace=None):
    """A copy of the FP8 directory with another ``quantization_config`` and/or tensors dropped or replaced."""
    path, block, _, saved, _ = edge_blocks
    config = json.loads((path / "fp8" / "config.json").read_text())
    if quantization is not None:
        config["quantization_config"] = quantization
    tensors = {name: t for name, t in {**saved, **(replace or {})}.items() if name not in drop}
    safetensors_torch.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return tmp_path


def test_fp8_dequantizes_to_the_configs_dtype(edge_blocks, tmp_path):
    path, block, _, saved, _ = edge_blocks
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # [64, 32]: a partial column block
    directory = _variant(edge_blocks, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    read = read_hf_tensors(directory, [name])
    assert list(read) == [name]
    assert torch.equal(read[name], _dequantize(saved[name], saved[name + "_scale_inv"], block).to(torch.bfloat16))


Q_A = "model.layers.0.self_attn.q_a_proj.weight"
REFUSALS = {
    "another fmt": (dict(quantization=_quantization([16, 24]) | {"fmt": "e5m2"}), UnsupportedHFModel, "fmt 'e5m2'"),
    "static activations": (
        dict(quantization=_quantization([16, 24]) | {"activation_scheme": "static"}),
        UnsupportedHFModel,
        "activation_scheme 'static'.*only 'dynamic'",
    ),
    "per-tensor scales": (
        dict(quantization=_quantization([16, 24]) | {"weight_block_size": None}),
        UnsupportedHFModel,
        "weight_block_size None.*per block",
    ),
    "another method": (
        dict(quantization={"quant_method": "gptq", "bits": 4}),
        UnsupportedHFModel,
        "quant_method 'gptq'.*dequantize the model first",
    ),
    "a missing scale": (dict(drop=[Q_A + "_scale_inv"]), ValueError, f"{Q_A} has no {Q_A}_scale_inv.*download"),
    "scales of another block": (
        dict(quantization=_quantization([16, 16])),
        ValueError,
        r"_scale_inv is \(2, 3\), but .*\[16, 16\] blocks has \(2, 4\).*set weight_block_size",
    ),
    "an unscaled weight scaled": (
        dict(replace={Q_A: torch.zeros(24, 64)}),
        ValueError,
        f"{Q_A}_scale_inv scales {Q_A}, which is not an FP8",
    ),
    "FP8 without a quantization_config": (
        dict(quantization={}),
        ValueError,
        "holds FP8 tensors .* no quantization_config: add",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_fp8_bad_input_refused_by_name(edge_blocks, tmp_path, case):
    changes, error, message = REFUSALS[case]
    with pytest.raises(error, match=message):
        ml.GPTModule.from_pretrained(_variant(edge_blocks, tmp_path, **changes))
