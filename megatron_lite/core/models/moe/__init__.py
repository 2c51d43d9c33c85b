"""Mixture-of-Experts: router -> dispatcher -> grouped experts -> combine (Megatron's semantics and names)."""
