import torch, torch.nn.functional as F
from megatron_lite.core.models import GPTConfig, GPTModel
from megatron_lite.core.estimator import measure_saved_tensors, estimate_for_run
for dev in ("cpu", "cuda"):
    for dt in (torch.float32, torch.bfloat16):
        s, b, n, d = 128, 2, 4, 64
        q, k, v = (torch.randn(s, b, n, d, device=dev, dtype=dt, requires_grad=True).permute(1, 2, 0, 3) for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        r = out.permute(2, 0, 1, 3).reshape(s, b, -1)
        print(dev, dt, "out", tuple(out.stride()), "reshape is view", r.data_ptr() == out.data_ptr(), tuple(r.stride()), out.grad_fn.name())
cfg = GPTConfig(num_layers=1, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=384, vocab_size=1000, seq_length=128)
for dev in ("cpu", "cuda"):
    for en in (False, True):
        with torch.device(dev):
            m = GPTModel(cfg).train()
        tok = torch.randint(0, 1000, (2, 128), device=dev)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=en):
            rep = measure_saved_tensors(m, lambda: (tok, tok))
        print(dev, en, [(str(x.dtype)[6:], x.shape, x.nbytes) for x in rep.storages])
