"""A reference Tinker-protocol training server on DeepSpeed's unmanaged gradient accumulation.

Layers, each its own module:

- ``wire`` / ``sampling``: Tinker's wire formats (the SDK's own protobuf modules), validation, result encoding.
- ``scheduler``: futures, strict per-model ``seq_id`` order, idempotent retries.
- ``api``: the requests the official ``tinker`` SDK (and tinker-cookbook) send, on rank 0.
- ``http_app``: their HTTP routes (FastAPI on uvicorn), the key check and the body limit.
- ``worker``: DeepSpeed engines in unmanaged mode, one per training model, on every rank.
- ``losses``: ``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``, each a SUM over tokens.
- ``sampler``: weight snapshots and generation on plain copies of the model, on every rank.
- ``server`` / ``launch``: the rank processes (any launcher; gloo/CPU or NCCL/GPU) and the local launcher.
- ``model`` / ``byte_tokenizer``: the byte-level models, local Hugging Face models, LoRA; a tokenizer for clients.
- ``tiny_models``: the tiny random Hugging Face models ``recipes-demo`` serves (and the tests use).

The demos' clients live in the repository's examples/tinker/; the tests in tests/tinker_server/.
"""
