"""kernels-triton's fused MoE: routing, alignment, grouped GEMMs, the top-k combine and their tile configs.

Reached through the `select_experts` / `fused_experts` custom ops (ops.py), which the worker binds into
the core's `FusedMoE` layers. Nothing is imported here: modules load when a provider is resolved.
"""
