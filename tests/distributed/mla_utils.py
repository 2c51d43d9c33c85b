"""Tiny multi-latent-attention shapes the MLA tests share (unit, distributed and Hugging Face ones)."""

TINY_MLA = dict(
    num_query_groups=None,  # MLA has one key and value per query head
    multi_latent_attention=True,
    kv_lora_rank=16,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=6,  # values narrower than queries/keys (12): every path must take their own width
)
"""GPTConfig fields of a tiny MLA (without query compression: add ``q_lora_rank``)."""

TINY_YARN = dict(
    rope_scaling_type="yarn",
    rope_scaling_factor=40.0,  # DeepSeek-V3's
    rope_original_max_position_embeddings=8,
    rope_mscale_all_dim=1.0,  # a softmax scale of 1.87 / sqrt(d)
)
"""GPTConfig fields of YaRN with DeepSeek's softmax rescaling."""

DEEPSEEK_V3_TINY = dict(
    vocab_size=200,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=2,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=4,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    qk_nope_head_dim=16,
    max_position_embeddings=128,
)
"""A DeepSeek-V3 ``config.json``'s shape (transformers' DeepseekV3Config keywords): a dense first layer, 8 routed
experts in 4 groups (top-4 from the best 2 groups), 2 shared experts."""
