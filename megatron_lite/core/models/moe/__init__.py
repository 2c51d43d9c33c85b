"""Mixture of Experts: router -> token dispatcher -> grouped experts -> combine (Megatron's MoE layer, torchtitan's
shape), each in a small file of its own; ``layer.py`` puts them together."""
