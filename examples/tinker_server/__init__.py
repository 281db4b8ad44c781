"""A reference Tinker-protocol training server on DeepSpeed's unmanaged gradient accumulation.

Layers, each its own module:

- ``wire``: Tinker's wire formats (the SDK's own protobuf modules), validation, result encoding.
- ``scheduler``: futures, strict per-model ``seq_id`` order, idempotent retries.
- ``api``: the HTTP endpoints the official ``tinker`` SDK calls (rank 0, loopback only).
- ``worker``: DeepSpeed engines in unmanaged mode, one per training model, on every rank.
- ``server`` / ``launch``: the rank processes and how they are started and stopped.
- ``model``: the small byte-level models and the cross-entropy SUM loss.
"""
