"""The server's configuration, one typed record: the command line is parsed into it once (``from_args``), and
``serve`` and the demos pass it to the ranks whole (``to_json``/``from_json``), so no option can be dropped on the
way. ``torchrun`` and the ``deepspeed`` launcher start ranks with the same flags instead (``rank``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .api import DEFAULT_MAX_CHUNK_DATUMS, DEFAULT_SESSION_TIMEOUT_S
from .faults import DEFAULT_DRAIN_S, DEFAULT_PEER_TIMEOUT_S
from .http_app import DEFAULT_MAX_BODY_BYTES
from .sampling import DEFAULT_SNAPSHOT_BYTES, MAX_SNAPSHOTS
from .scheduler import DEFAULT_FUTURE_TTL_S, DEFAULT_MAX_FUTURES, DEFAULT_RETRIEVED_GRACE_S
from .vllm_sampler import DEFAULT_ADAPTERS, DEFAULT_MAX_LORA_RANK, VLLM_PYTHON_ENV, VllmOptions

#: Relative to the working directory the server starts in.
DEFAULT_CHECKPOINTS = Path("scratch") / "tinker_checkpoints"


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server's ranks are told; each field is one command-line option (``from_args`` says which)."""

    #: Rank 0's HTTP port (``--port``; 0 picks a free one) and where it writes ``{base_url, pid}`` once serving.
    port: int = 8000
    ready_file: Path | None = None
    zero_stage: int = 1
    #: Where checkpoints, the run store and the byte tokenizer go (``--checkpoint-dir``).
    checkpoint_root: Path = DEFAULT_CHECKPOINTS
    #: Datums per forward_backward request the SDK is told to send at most (``--max-chunk-datums``).
    max_chunk_datums: int = DEFAULT_MAX_CHUNK_DATUMS
    #: Ask the SDK to zstd request bodies (``--no-compress`` turns it off).
    compress_fwdbwd: bool = True
    #: How long retrieve_future holds a pending request before ``try_again`` (``--long-poll-s``).
    long_poll_s: float = 10.0
    #: Local Hugging Face model directories to serve besides the built-in byte-level models (``PATH`` or
    #: ``NAME=PATH``).
    base_models: tuple[str, ...] = ()
    #: Interface rank 0's HTTP server binds (loopback unless told otherwise).
    host: str = "127.0.0.1"
    #: ``auto`` (CUDA when there are GPUs), ``cuda`` or ``cpu``.
    device: str = "auto"
    #: ``fp32`` or ``bf16`` (DeepSpeed's bf16 mode; the samplers' copies in bf16 too).
    dtype: str = "fp32"
    #: Recompute each decoder layer's activations in backward (``--gradient-checkpointing``).
    gradient_checkpointing: bool = False
    #: Keep only each training run's K newest training and K newest sampler checkpoints (``--keep-checkpoints``).
    keep_checkpoints: int | None = None
    #: Request bodies over this many bytes get 413 (``--max-body-bytes``).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: One log line per HTTP request (``--no-access-log`` turns it off).
    access_log: bool = True
    #: After a rank dies or a collective fails: how long rank 0 answers every request with the error before it
    #: exits with ``EXIT_RANK_FAILED`` (``--fault-drain-s``).
    fault_drain_s: float = DEFAULT_DRAIN_S
    #: A rank silent this long counts as dead (``--peer-timeout-s``); a rank that exits is seen at once.
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S
    #: Unnamed sampler snapshots each rank keeps, at most, and their bytes at most (the newest is always kept).
    sampler_snapshots: int = MAX_SNAPSHOTS
    sampler_snapshot_bytes: int = DEFAULT_SNAPSHOT_BYTES
    #: The API keys to accept, one per line (``--api-keys-file``; ``$DEEPSPEED_TINKER_API_KEYS`` adds more).
    api_keys_file: Path | None = None
    #: Futures held at most (pending + finished and kept); past it new work gets 429 (``--max-futures``).
    max_futures: int = DEFAULT_MAX_FUTURES
    #: Futures one session holds at most (``--max-futures-per-session``; None: a quarter of ``max_futures``).
    max_futures_per_session: int | None = None
    #: How long a finished result nobody retrieves is kept (``--future-ttl-s``).
    future_ttl_s: float = DEFAULT_FUTURE_TTL_S
    #: How long a retrieved result is kept, for the SDK's retries (``--retrieved-grace-s``).
    retrieved_grace_s: float = DEFAULT_RETRIEVED_GRACE_S
    #: torch intra-op threads per rank (``--threads-per-rank``); None: the rank's share of the cores (``threads``).
    threads_per_rank: int | None = None
    #: A session without a heartbeat or request for this long is closed (``--session-timeout-s``; 0: never).
    session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_S
    #: ``native`` (the ranks decode, in their job queue) or ``vllm`` (``--sampler``; see ``vllm_sampler``).
    sampler: str = "native"
    #: vLLM's Python, to start vLLM with (``--vllm-python``), or the URL of a vLLM already serving (``--vllm-url``).
    vllm_python: str | None = None
    vllm_url: str | None = None
    #: LoRA adapters registered with vLLM at once, and the largest LoRA rank it is started for.
    vllm_adapters: int = DEFAULT_ADAPTERS
    vllm_max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    #: torch threads of vLLM's CPU worker (``--vllm-threads``).
    vllm_threads: int = 1

    def __post_init__(self) -> None:
        # Options that cannot go together end the command where the configuration is made, before any rank starts
        # (and on every rank alike: each makes its configuration from the same flags or JSON).
        if self.sampler == "vllm" and len(self.base_models) != 1:
            raise SystemExit("error: --sampler vllm serves exactly one --base-model (a local Hugging Face directory); "
                             f"got {len(self.base_models)}")

    def vllm_options(self) -> VllmOptions:
        return VllmOptions(python=self.vllm_python, url=self.vllm_url, adapters=self.vllm_adapters,
                           max_lora_rank=self.vllm_max_lora_rank, threads=self.vllm_threads)

    def to_json(self) -> str:
        return json.dumps({name: str(value) if isinstance(value, Path) else value
                           for name, value in dataclasses.asdict(self).items()})

    @classmethod
    def from_json(cls, text: str) -> ServerConfig:
        values = json.loads(text)
        for field in dataclasses.fields(cls):
            if "Path" in str(field.type) and values.get(field.name) is not None:
                values[field.name] = Path(values[field.name])
        values["base_models"] = tuple(values.get("base_models", ()))
        return cls(**values)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """The server's options as ``serve``, ``rank`` and the demos parse them (``__main__._server_options``)."""
        return cls(port=getattr(args, "port", 0), ready_file=getattr(args, "ready_file", None),
                   zero_stage=args.zero_stage, checkpoint_root=args.checkpoint_dir,
                   max_chunk_datums=args.max_chunk_datums, compress_fwdbwd=not args.no_compress,
                   long_poll_s=args.long_poll_s, base_models=tuple(args.base_model),
                   host=getattr(args, "host", "127.0.0.1"), device=args.device, dtype=args.dtype,
                   gradient_checkpointing=args.gradient_checkpointing, keep_checkpoints=args.keep_checkpoints,
                   max_body_bytes=args.max_body_bytes, access_log=not args.no_access_log,
                   fault_drain_s=args.fault_drain_s, peer_timeout_s=args.peer_timeout_s,
                   sampler_snapshots=args.sampler_snapshots, sampler_snapshot_bytes=args.sampler_snapshot_mib << 20,
                   api_keys_file=args.api_keys_file, max_futures=args.max_futures,
                   max_futures_per_session=args.max_futures_per_session, future_ttl_s=args.future_ttl_s,
                   retrieved_grace_s=args.retrieved_grace_s, threads_per_rank=args.threads_per_rank,
                   session_timeout_s=args.session_timeout_s, sampler=args.sampler,
                   vllm_python=args.vllm_python or os.environ.get(VLLM_PYTHON_ENV) or None, vllm_url=args.vllm_url,
                   vllm_adapters=args.vllm_adapters, vllm_max_lora_rank=args.vllm_max_lora_rank,
                   vllm_threads=args.vllm_threads)
