"""Benchmarks for DeepSpeed's unmanaged gradient accumulation (``"managed_gradient_accumulation": false``).

``python -m ds_bench run`` measures, side by side, what owning the gradient-accumulation boundary
costs: collectives and bytes, wall time and peak memory per logical step. See ``benchmarks/README.md``.
"""
