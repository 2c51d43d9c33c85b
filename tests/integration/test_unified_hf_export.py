"""Quantized Hugging Face export (ModelOpt's unified checkpoint) checked from the files alone.

A tiny GQA model is quantized with our PTQ entry point for FP8, INT8 SmoothQuant, INT4 AWQ and W4A8 AWQ (and an
FP8 KV cache), exported, and then read back the way a serving engine reads it: ``hf_quant_config.json`` names
the algorithm, each linear's weight is stored in the quantized dtype (float8_e4m3fn / int8 / two int4 per uint8)
with its scales, and a *deployment emulator* written here from the format alone (dequantize the stored weights;
``x * pre_quant_scale``, or the RMSNorm AWQ folded it into; fake-quantize the input with ``input_scale``) gives
each linear's quantized input as ours and, run on transformers' own Llama, our fake-quantized model's logits. The
dequantized weights equal our fake-quantized weights (split into q/k/v and gate/up) to float rounding: the export
carries our calibration, not a new one. Nothing is downloaded."""

from __future__ import annotations

import copy
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

mtq = pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")
safetensors = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (comes with transformers)")

from megatron_lite.core.checkpoint.hf.weights import _split_qkv  # noqa: E402
from megatron_lite.core.models.config import GPTConfig  # noqa: E402
from megatron_lite.core.models.gpt import GPTModel  # noqa: E402
from megatron_lite.post_training.export import read_quant_config, save_quantized_hf  # noqa: E402
from megatron_lite.post_training.quantization import quantize  # noqa: E402

# hidden 128: INT4 AWQ quantizes blocks of 128 input channels and the export packs whole blocks only
CONFIG = GPTConfig(
    num_layers=2,
    hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=256,
    vocab_size=200,
    seq_length=16,
)
FP8_MAX = 448.0


def quantized(seed, cfg_name, kv=False):
    """A tiny GPTModel quantized by our PTQ entry point, calibrated on 4 random sequences; (model, tokens)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_length + 1), generator=generator)
    model = GPTModel(CONFIG, seed=seed)
    quantize(model, cfg_name, [{"tokens": tokens}], kv_cache="FP8_KV_CFG" if kv else None)
    return model.eval(), tokens[:, :-1]


# ---- the deployment emulator: reads only the exported files ----


def dequantize(tensors, group_size):
    """HF state dict of the stored weights in float32 (quantized ones times their scales); scales dropped."""
    out = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale", ".pre_quant_scale", "_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[name + "_scale"]
            out[name] = t.float() * (scale if scale.dim() == 0 else scale[:, None])
        elif t.dtype == torch.int8:
            out[name] = t.float() * tensors[name + "_scale"][:, None]
        elif t.dtype == torch.uint8:  # two int4 per byte: output rows 2j (low nibble) and 2j+1 (high nibble)
            low, high = (t & 0xF).to(torch.int16), (t >> 4).to(torch.int16)
            q = torch.stack([low, high], dim=1).reshape(2 * t.shape[0], t.shape[1])
            q = (q ^ 8) - 8  # two's-complement nibble -> [-8, 7]
            out[name] = q.float() * tensors[name + "_scale"].repeat_interleave(group_size, dim=1)
            if name + "_scale_2" in tensors:  # W4A8: the INT4 weight is then held in FP8 with this per-tensor scale
                scale_2 = tensors[name + "_scale_2"]
                out[name] = (out[name] / scale_2).to(torch.float8_e4m3fn).float() * scale_2
        else:
            out[name] = t.float()
    return out


def fake_quant_input(x, scale, algo):
    if algo in ("FP8", "W4A8_AWQ"):
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    if algo == "W8A8_SQ_PER_CHANNEL":
        return torch.round(x / scale).clamp(-128, 127) * scale
    return x  # weight-only (W4A16 AWQ)


def deployed_logits(directory, tokens):
    quant = read_quant_config(directory)["quantization"]
    hf = json.loads((directory / "config.json").read_text())
    hf.pop("quantization_config")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf)).float().eval()
    tensors = safetensors.load_file(str(directory / "model.safetensors"))
    model.load_state_dict(dequantize(tensors, quant.get("group_size", 0)), strict=True)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name + ".weight_scale" in tensors:
            pqs, scale = tensors.get(name + ".pre_quant_scale"), tensors.get(name + ".input_scale")

            def hook(_, args, pqs=pqs, scale=scale):
                x = args[0] if pqs is None else args[0] * pqs
                return (x if scale is None else fake_quant_input(x, scale, quant["quant_algo"]),)

            module.register_forward_pre_hook(hook)
    with torch.no_grad():
        return model(tokens).logits


def split_like_hf(fused, i):
    """{HF name under model.layers.i.: rows} of our four per-layer linears' [out, ...] tensors."""
    p, f = f"model.layers.{i}.", CONFIG.ffn_hidden_size
    q, k, v = _split_qkv(fused["qkv"], CONFIG)
    return {
        p + "self_attn.q_proj": q,
        p + "self_attn.k_proj": k,
        p + "self_attn.v_proj": v,
        p + "self_attn.o_proj": fused["proj"],
        p + "mlp.gate_proj": fused["fc1"][:f],
        p + "mlp.up_proj": fused["fc1"][f:],
        p + "mlp.down_proj": fused["fc2"],
    }


def our_linears(layer):
    return {
        "qkv": layer.self_attention.linear_qkv,
        "proj": layer.self_attention.linear_proj,
        "fc1": layer.mlp.linear_fc1,
        "fc2": layer.mlp.linear_fc2,
    }


def our_fake_quant_weights(model):
    """{HF module name: our fake-quantized weight} (the fused ones split as the export splits them)."""
    out = {}
    for i in range(CONFIG.num_layers):
        fused = {n: m.weight_quantizer(m.weight).detach() for n, m in our_linears(model.layers[str(i)]).items()}
        out.update(split_like_hf(fused, i))
    return out


def our_linear_inputs(model, tokens):
    """{HF module name: (the input our fused linear saw, that linear's input quantizer)}."""
    seen = {}
    hooks = [
        m.register_forward_hook(lambda mod, a, o, key=(i, n): seen.__setitem__(key, (a[0], mod.input_quantizer)))
        for i in range(CONFIG.num_layers)
        for n, m in our_linears(model.layers[str(i)]).items()
    ]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    kind = {
        "q_proj": "qkv",
        "k_proj": "qkv",
        "v_proj": "qkv",
        "o_proj": "proj",
        "gate_proj": "fc1",
        "up_proj": "fc1",
        "down_proj": "fc2",
    }
    return {
        name: seen[(i, kind[name.rsplit(".", 1)[1]])]
        for i in range(CONFIG.num_layers)
        for name in split_like_hf(
            {
                "qkv": torch.zeros((CONFIG.num_attention_heads + 2 * CONFIG.num_query_groups) * CONFIG.kv_channels),
                "proj": None,
                "fc1": torch.zeros(2 * CONFIG.ffn_hidden_size),
                "fc2": None,
            },
            i,
        )
    }


CASES = {  # config -> (quant_algo, stored weight dtype, has input_scale, has pre_quant_scale on q_proj)
    "FP8_DEFAULT_CFG": ("FP8", torch.float8_e4m3fn, True, False),
    "INT8_SMOOTHQUANT_CFG": ("W8A8_SQ_PER_CHANNEL", torch.int8, True, True),
    "INT4_AWQ_CFG": ("W4A16_AWQ", torch.uint8, False, False),  # AWQ folds q/k/v's pre_quant_scale into the norm
    "W4A8_AWQ_BETA_CFG": ("W4A8_AWQ", torch.uint8, True, False),
}


@pytest.mark.parametrize("cfg_name", sorted(CASES))
def test_quantized_export_reproduces_our_fake_quantized_model(cfg_name, tmp_path):
    algo, dtype, has_input_scale, has_pqs = CASES[cfg_name]
    model, tokens = quantized(7, cfg_name)
    out = tmp_path / "hf"
    save_quantized_hf(out, model, dtype="float32")

    quant = json.loads((out / "hf_quant_config.json").read_text())
    assert quant["producer"]["name"] == "modelopt" and quant["quantization"]["quant_algo"] == algo
    assert quant["quantization"]["exclude_modules"] == ["lm_head"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    tensors = safetensors.load_file(str(out / "model.safetensors"))
    q = "model.layers.1.self_attn.q_proj."
    assert tensors[q + "weight"].dtype == dtype and tensors[q + "weight_scale"].dtype == torch.float32
    assert (q + "input_scale" in tensors) == has_input_scale and (q + "pre_quant_scale" in tensors) == has_pqs
    assert tensors["lm_head.weight"].dtype == torch.float32

    deq = dequantize(tensors, quant["quantization"].get("group_size", 0))
    for name, weight in our_fake_quant_weights(model).items():
        # equal to float rounding, except where w / scale lands on a rounding tie: there the file and ModelOpt's
        # fake quantization (w * (127 / amax)) may round to neighbouring steps -- one step apart, rarely
        step = tensors[name + ".weight_scale"].float()
        step = (
            step.repeat_interleave(weight.shape[1] // step.shape[1], dim=1)
            if step.dim() == 2
            else (step[:, None] if step.dim() == 1 else step)
        )
        diff = (deq[name + ".weight"] - weight).abs()
        assert bool((diff <= step * 1.001).all()), name
        assert int((diff > 1e-6 * weight.abs() + 1e-8).sum()) <= max(1, weight.numel() // 10000), name

    # each linear's input, rebuilt from the files alone (pre_quant_scale, input_scale), is the one our linear computes
    norms = {"self_attn": "input_layernorm", "mlp": "pre_mlp_layernorm"}
    hf_norms = {"self_attn": "input_layernorm", "mlp": "post_attention_layernorm"}
    for name, (x, quantizer) in our_linear_inputs(model, tokens).items():
        pqs, scale = tensors.get(name + ".pre_quant_scale"), tensors.get(name + ".input_scale")
        ours_pqs = getattr(quantizer, "_pre_quant_scale", None)
        if pqs is None and ours_pqs is not None:  # AWQ folded it into the RMSNorm before q/k/v and gate/up
            _, _, i, block, _ = name.split(".")
            folded = tensors[f"model.layers.{i}.{hf_norms[block]}.weight"]
            torch.testing.assert_close(folded, getattr(model.layers[i], norms[block]).weight.detach() * ours_pqs)
            pqs = ours_pqs  # the folded norm's output is ours times it
        smoothed = x if pqs is None else x * pqs
        emulated = smoothed if scale is None else fake_quant_input(smoothed, scale, algo)
        torch.testing.assert_close(emulated, quantizer(x), rtol=1e-6, atol=1e-7)

    with torch.no_grad():
        expected = model(tokens).float()[..., : CONFIG.vocab_size]
        plain = copy.deepcopy(model)
        mtq.disable_quantizer(plain, "*")
        unquantized = plain(tokens).float()[..., : CONFIG.vocab_size]
    got = deployed_logits(out, tokens)
    err = (got - expected).norm() / expected.norm()
    quant_effect = (unquantized - expected).norm() / expected.norm()
    assert quant_effect > 1e-3  # the quantization changes the function measurably ...
    if has_input_scale:
        # ... and the whole exported model reproduces it. Quantized activations round to discrete steps, so
        # transformers' RMSNorm and attention (equal to ours to float rounding) flip a few of those roundings, and
        # one flip moves a layer's output by ~3e-4 relative (each linear alone matched to 1e-5 above). Measured:
        # 3e-4 to 5e-4 against a quantization effect of 1e-2 to 4e-2.
        assert err < 0.1 * quant_effect
    else:
        assert err < 1e-5  # weight-only INT4: the same function to float rounding


def test_fp8_kv_cache_scales_are_exported(tmp_path):
    model, _ = quantized(3, "FP8_DEFAULT_CFG", kv=True)
    save_quantized_hf(tmp_path / "hf", model)  # bfloat16 by default: what serving engines run
    quant = read_quant_config(tmp_path / "hf")["quantization"]
    assert quant["quant_algo"] == "FP8" and quant["kv_cache_quant_algo"] == "FP8"
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["torch_dtype"] == "bfloat16"
    assert hf_config["quantization_config"]["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    tensors = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    for i in range(CONFIG.num_layers):
        attention = model.layers[str(i)].self_attention
        for kind in ("k", "v"):
            amax = getattr(attention, f"{kind}_bmm_quantizer").amax.float()
            torch.testing.assert_close(tensors[f"model.layers.{i}.self_attn.{kind}_proj.{kind}_scale"], amax / FP8_MAX)
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.self_attn.q_proj.input_scale"].dtype == torch.float32


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    plain = GPTModel(CONFIG, seed=3)
    with pytest.raises(ValueError, match="no enabled quantizer: quantize it first"):
        save_quantized_hf(tmp_path / "a", plain)
    with pytest.raises(TypeError, match="takes a GPTModel"):
        save_quantized_hf(tmp_path / "b", torch.nn.Linear(2, 2))
    compressed, _ = quantized(3, "FP8_DEFAULT_CFG")
    mtq.compress(compressed)  # real FP8 weights: the export quantizes fake-quantized weights itself
    with pytest.raises(ValueError, match=r"real-quantized .* \(before modelopt's mtq.compress\)"):
        save_quantized_hf(tmp_path / "c", compressed)
    assert not any(tmp_path.iterdir())


def test_convert_cli_writes_a_quantized_checkpoint_in_the_unified_format(tmp_path, capsys):
    """`megatron-lite convert --to hf` on a checkpoint of a quantized module: the model is restored with its
    quantizers from the checkpoint (no calibration) and the export equals the in-memory model's, tensor for tensor."""
    import megatron_lite as ml
    from megatron_lite.cli.convert import main as convert_main
    from megatron_lite.pretrained import save_weights_checkpoint

    module = ml.GPTModule(CONFIG)
    module.configure_model()
    tokens = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_length + 1), generator=torch.Generator().manual_seed(5))
    quantize(module, "INT8_SMOOTHQUANT_CFG", [{"tokens": tokens}], kv_cache="FP8_KV_CFG")
    save_weights_checkpoint(module, tmp_path / "ckpt")
    save_quantized_hf(tmp_path / "direct", module.model)

    assert convert_main(["--to", "hf", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "cli")]) == 0
    assert "quantized W8A8_SQ_PER_CHANNEL (KV cache FP8)" in capsys.readouterr().out
    assert read_quant_config(tmp_path / "cli") == read_quant_config(tmp_path / "direct")
    cli = safetensors.load_file(str(tmp_path / "cli" / "model.safetensors"))
    direct = safetensors.load_file(str(tmp_path / "direct" / "model.safetensors"))
    assert cli.keys() == direct.keys()
    for name in direct:
        bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731  (bit for bit, fp8 included)
        assert cli[name].dtype == direct[name].dtype and torch.equal(bits(cli[name]), bits(direct[name])), name
