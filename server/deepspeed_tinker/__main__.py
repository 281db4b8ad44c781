"""Command line: ``deepspeed-tinker {serve,demo,rl-demo,recipes-demo,rank}`` (or ``python -m deepspeed_tinker``).

``rank`` is one process of a server; ``serve`` starts W of them itself, and ``torchrun`` or the
``deepspeed`` launcher can start them instead (see docs/tinker-server/deployment.md).
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from .api import DEFAULT_MAX_CHUNK_DATUMS, DEFAULT_SESSION_TIMEOUT_S
from .config import DEFAULT_CHECKPOINTS, ServerConfig
from .faults import DEFAULT_DRAIN_S, DEFAULT_PEER_TIMEOUT_S
from .http_app import DEFAULT_MAX_BODY_BYTES
from .keys import KEYS_ENV, check_host, load_api_keys
from .launch import ServerProcess, serve
from .model import parse_base_model
from .sampling import DEFAULT_SNAPSHOT_BYTES, MAX_SNAPSHOTS
from .scheduler import DEFAULT_FUTURE_TTL_S, DEFAULT_MAX_FUTURES, DEFAULT_RETRIEVED_GRACE_S
from .vllm_sampler import DEFAULT_ADAPTERS, DEFAULT_MAX_LORA_RANK, VLLM_PYTHON_ENV

#: Environment variable naming the folder of the demos' clients (default: the checkout's examples/tinker/).
CLIENTS_ENV = "DEEPSPEED_TINKER_CLIENTS"


def _positive_int(value: str) -> int:
    """An argparse type: a whole number >= 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return number


def _demo_options(parser: argparse.ArgumentParser, client: str) -> None:
    """What every demo takes: the client's Python, a time limit, the access log, and every option of the server
    (passed on to it, but the few ``_demo_server`` decides)."""
    parser.add_argument("--client-python", default=sys.executable,
                        help=f"Python that has {client} (default: this one)")
    parser.add_argument("--timeout-s", type=float, default=900,
                        help="stop the client (and the server) after S seconds (default: %(default)s)")
    parser.add_argument("--access-log", action="store_true", help="the server's log line per HTTP request")
    _server_options(parser)


def _server_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=1)
    parser.add_argument("--checkpoint-dir", type=Path, default=DEFAULT_CHECKPOINTS,
                        help="where save_weights writes (default: %(default)s)")
    parser.add_argument("--max-chunk-datums", type=_positive_int, default=DEFAULT_MAX_CHUNK_DATUMS,
                        help="datums per forward_backward request the SDK is told to send at most (a larger call "
                        "is split into chunks of this many; default: %(default)s, chosen by measurement, "
                        "docs/tinker-server/service.md)")
    parser.add_argument("--no-compress", action="store_true", help="do not ask the SDK to zstd request bodies")
    parser.add_argument("--long-poll-s", type=float, default=10.0,
                        help="how long retrieve_future holds a pending request before answering try_again")
    parser.add_argument("--base-model", action="append", default=[], metavar="[NAME=]PATH",
                        help="a local Hugging Face causal LM directory to serve (repeatable); clients name it by "
                        "its absolute path, or by NAME (e.g. the Hugging Face name Qwen/Qwen3-8B) when given")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="auto: one GPU per rank with NCCL when CUDA GPUs exist, else the CPU with gloo")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="model weights and compute: fp32, or bf16 (DeepSpeed's bf16 mode: fp32 master weights "
                        "and Adam state)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute each decoder layer's activations in backward instead of keeping them")
    parser.add_argument("--keep-checkpoints", type=_positive_int, default=None, metavar="K",
                        help="keep only each training run's K newest training and K newest sampler checkpoints, "
                        "deleting older ones after each save (default: keep all)")
    parser.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                        help="request bodies over N bytes get 413 without being read (default: %(default)s)")
    parser.add_argument("--no-access-log", action="store_true", help="no log line per HTTP request")
    parser.add_argument("--max-futures", type=_positive_int, default=DEFAULT_MAX_FUTURES, metavar="N",
                        help="requests held at most, pending or finished and not yet expired; past it new work gets "
                        "429 (never is a pending request dropped) (default: %(default)s)")
    parser.add_argument("--max-futures-per-session", type=_positive_int, default=None, metavar="N",
                        help="requests one session holds at most; past it that session's new work gets 429 and the "
                        "others' does not (a request that releases requests already accepted never does) "
                        "(default: a quarter of --max-futures)")
    parser.add_argument("--future-ttl-s", type=float, default=DEFAULT_FUTURE_TTL_S, metavar="S",
                        help="how long a finished request's result is kept if it is never retrieved "
                        "(default: %(default)s)")
    parser.add_argument("--retrieved-grace-s", type=float, default=DEFAULT_RETRIEVED_GRACE_S, metavar="S",
                        help="how long a retrieved result is kept, for the SDK's retries (default: %(default)s)")
    parser.add_argument("--threads-per-rank", type=_positive_int, default=None, metavar="N",
                        help="torch intra-op threads per rank (default: $OMP_NUM_THREADS if set, else the cores this "
                        "process may use divided by the ranks on this node)")
    parser.add_argument("--session-timeout-s", type=float, default=DEFAULT_SESSION_TIMEOUT_S, metavar="S",
                        help="close a session (unload its models on every rank, fail its waiting requests) after S "
                        "seconds without a heartbeat or request; the SDK heartbeats every 10 s; 0: never "
                        "(default: %(default)s)")
    parser.add_argument("--api-keys-file", type=Path, default=None, metavar="FILE",
                        help=f"the API keys to accept, one per line (plus ${KEYS_ENV}, comma-separated); any other "
                        "key gets 401. Without keys: any 'tml-' key, loopback only")
    parser.add_argument("--fault-drain-s", type=float, default=DEFAULT_DRAIN_S, metavar="S",
                        help="after a rank dies or a collective fails, answer every request with the error for S "
                        "seconds, then exit with code 3 (default: %(default)s)")
    parser.add_argument("--peer-timeout-s", type=float, default=DEFAULT_PEER_TIMEOUT_S, metavar="S",
                        help="a rank that sends rank 0 no heartbeat for S seconds counts as dead (one that exits is "
                        "seen at once) (default: %(default)s)")
    parser.add_argument("--sampler-snapshots", type=_positive_int, default=MAX_SNAPSHOTS, metavar="N",
                        help="unnamed sampler snapshots (save_weights_and_get_sampling_client) each rank keeps in "
                        "memory, at most (default: %(default)s)")
    parser.add_argument("--sampler-snapshot-mib", type=_positive_int, default=DEFAULT_SNAPSHOT_BYTES >> 20,
                        metavar="MIB", help="their memory per rank at most; the newest is always kept "
                        "(default: %(default)s)")
    parser.add_argument("--sampler", choices=["native", "vllm"], default="native",
                        help="native: the ranks decode, queued with training; vllm: a vLLM server in its own "
                        "environment samples beside training (LoRA snapshots as adapters; one --base-model)")
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help=f"the Python of vLLM's environment, to start vLLM with (default: ${VLLM_PYTHON_ENV}; "
                        "tools/vllm-env.sh builds one)")
    parser.add_argument("--vllm-url", default=None, metavar="URL",
                        help="a vLLM OpenAI-compatible server already serving the base model (started with "
                        "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), instead of starting one")
    parser.add_argument("--vllm-adapters", type=_positive_int, default=DEFAULT_ADAPTERS, metavar="N",
                        help="LoRA sampler snapshots registered with vLLM at once; one sampled again after it left "
                        "is registered again from disk (default: %(default)s)")
    parser.add_argument("--vllm-max-lora-rank", type=_positive_int, default=DEFAULT_MAX_LORA_RANK, metavar="R",
                        help="the largest LoRA rank vLLM is started for; create_model refuses a higher one "
                        "(default: %(default)s)")
    parser.add_argument("--vllm-threads", type=_positive_int, default=1, metavar="N",
                        help="torch threads of vLLM's CPU worker (default: %(default)s)")


def _client(name: str) -> str:
    """A demo client script: from ``$DEEPSPEED_TINKER_CLIENTS``, else the examples/tinker/ folder of the checkout this
    package is installed (editable) from. The clients are examples, not part of the installed server."""
    folder = Path(os.environ.get(CLIENTS_ENV) or Path(__file__).resolve().parents[2] / "examples" / "tinker")
    script = folder / name
    if not script.is_file():
        raise SystemExit(f"error: the demo client {script} does not exist; set ${CLIENTS_ENV} to the examples/tinker/ "
                         "folder of a checkout of this project")
    return str(script)


def _demo_server(args: argparse.Namespace, checkpoints: Path,
                 *base_models: str) -> tuple[ServerProcess, dict[str, str]]:
    """A demo's server, given every server option the command line gave, and its client's environment.

    The demo decides four: CPU ranks unless ``--device`` names one (the demos are sized for 2 CPU cores), no access
    log unless ``--access-log`` (the demos print their clients' progress, not a line per request), a fresh API key
    (``TINKER_API_KEY`` in the client's environment, which the SDK reads), and its checkpoints in a folder of its own.
    """
    key = f"tml-demo-{secrets.token_hex(16)}"
    checkpoints.mkdir(parents=True, exist_ok=True)
    keys_file = checkpoints / "api-keys"
    keys_file.touch(mode=0o600)
    keys_file.write_text(key + "\n")
    config = replace(ServerConfig.from_args(args), port=0, checkpoint_root=checkpoints,
                     device="cpu" if args.device == "auto" else args.device, access_log=args.access_log,
                     api_keys_file=keys_file, base_models=resolved_base_models([*args.base_model, *base_models]))
    return ServerProcess(world_size=args.world_size, config=config), {**os.environ, "TINKER_API_KEY": key}


def _demo(args: argparse.Namespace) -> int:
    """Start a server on ``--world-size`` CPU ranks, run the SFT client against it, stop the server."""
    checkpoints = args.checkpoint_dir / "demo"
    server, client_env = _demo_server(args, checkpoints)
    print(f"[demo] starting the server on {args.world_size} CPU ranks (ZeRO stage {args.zero_stage})", flush=True)
    base_url = server.start()
    try:
        client = [args.client_python, _client("sft_client.py"), "--base-url", base_url,
                  "--rank", str(args.rank), "--steps", str(args.steps)]
        return subprocess.run(client, timeout=args.timeout_s, env=client_env).returncode
    finally:
        code = server.stop()
        print(f"[demo] server stopped (exit code {code})", flush=True)


def _rl_demo(args: argparse.Namespace) -> int:
    """Start a server on ``--world-size`` CPU ranks, run tinker-cookbook's RL loop against it, stop the server."""
    checkpoints = args.checkpoint_dir / "rl-demo"
    server, client_env = _demo_server(args, checkpoints)
    print(f"[rl-demo] starting the server on {args.world_size} CPU ranks (ZeRO stage {args.zero_stage})", flush=True)
    base_url = server.start()
    try:
        client = [args.client_python, _client("rl_client.py"), "--base-url", base_url,
                  "--log-dir", str(checkpoints / "cookbook-log")]
        return subprocess.run(client, timeout=args.timeout_s, env=client_env).returncode
    finally:
        code = server.stop()
        print(f"[rl-demo] server stopped (exit code {code})", flush=True)


def _recipes_demo(args: argparse.Namespace) -> int:
    """Serve a tiny random Qwen3 as ``Qwen/Qwen3-8B`` on ``--world-size`` CPU ranks, run tinker-cookbook's
    ``recipes/sl_basic`` against it unmodified (recipes_client.py), stop the server."""
    from .tiny_models import build_tiny_model

    checkpoints = args.checkpoint_dir / "recipes-demo"
    model_dir = build_tiny_model(checkpoints / "qwen3-tiny", "qwen3")
    server, client_env = _demo_server(args, checkpoints, f"Qwen/Qwen3-8B={model_dir}")
    print(f"[recipes-demo] starting the server on {args.world_size} CPU ranks (ZeRO stage {args.zero_stage})",
          flush=True)
    base_url = server.start()
    try:
        client = [args.client_python, _client("recipes_client.py"), "--base-url", base_url,
                  "--model-dir", str(model_dir), "--log-dir", str(checkpoints / "cookbook-log"), "--steps",
                  str(args.steps)]
        return subprocess.run(client, timeout=args.timeout_s, env=client_env).returncode
    finally:
        code = server.stop()
        print(f"[recipes-demo] server stopped (exit code {code})", flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``serve``, the three demos and ``rank``."""
    parser = argparse.ArgumentParser(prog="deepspeed-tinker",
                                     description="A Tinker-protocol training server on DeepSpeed (unmanaged mode).")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_cmd = commands.add_parser("serve", help="serve from W local ranks until SIGTERM/SIGINT")
    serve_cmd.add_argument("--world-size", type=int, default=None,
                           help="ranks: default one per CUDA GPU, or 2 on the CPU")
    serve_cmd.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve_cmd.add_argument("--host", default="127.0.0.1", help="interface to serve HTTP on (default: loopback only)")
    serve_cmd.add_argument("--ready-file", type=Path, help="rank 0 writes {base_url, pid} here once serving")
    _server_options(serve_cmd)

    demo_cmd = commands.add_parser("demo", help="server on 2 CPU ranks + the SDK's SFT client, then stop")
    demo_cmd.add_argument("--world-size", type=int, default=2)
    demo_cmd.add_argument("--steps", type=int, default=8)
    demo_cmd.add_argument("--rank", type=int, default=16, help="LoRA rank; 0 for full fine-tuning (default: 16)")
    _demo_options(demo_cmd, "the tinker SDK")
    # Its client's first step is one call of every datum: chunks of 8 show the SDK splitting it.
    demo_cmd.set_defaults(max_chunk_datums=8)

    rl_cmd = commands.add_parser("rl-demo", help="server on 2 CPU ranks + tinker-cookbook's RL loop, then stop")
    rl_cmd.add_argument("--world-size", type=int, default=2)
    _demo_options(rl_cmd, "tinker-cookbook")

    recipes_cmd = commands.add_parser("recipes-demo",
                                      help="server on 2 CPU ranks + tinker-cookbook's recipes/sl_basic, unmodified, "
                                      "on a tiny Qwen3 served as Qwen/Qwen3-8B, then stop")
    recipes_cmd.add_argument("--world-size", type=int, default=2)
    recipes_cmd.add_argument("--steps", type=int, default=8)
    _demo_options(recipes_cmd, "tinker-cookbook")

    rank_cmd = commands.add_parser("rank", help="one rank of a server: `serve` starts these; so can torchrun "
                                   "or the deepspeed launcher (RANK, WORLD_SIZE, MASTER_ADDR/PORT from them)")
    rank_cmd.add_argument("--port", type=int, default=8000, help="rank 0's HTTP port; 0 picks a free one")
    rank_cmd.add_argument("--host", default="127.0.0.1", help="interface rank 0 serves HTTP on")
    rank_cmd.add_argument("--ready-file", type=Path)
    _server_options(rank_cmd)

    # The deepspeed launcher passes --local_rank=N before the command (LOCAL_RANK is in the environment too).
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    for command in (serve_cmd, rank_cmd):  # the whole configuration as one JSON value (serve to its ranks)
        command.add_argument("--config-json", help=argparse.SUPPRESS)
    return parser


def resolved_base_models(values: list[str]) -> tuple[str, ...]:
    """``--base-model`` values with absolute paths: the ranks may start in another directory."""
    out = []
    for value in values:
        name, path = parse_base_model(value)
        resolved = str(Path(path).expanduser().resolve())
        out.append(f"{name}={resolved}" if name else resolved)
    return tuple(out)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """``serve``'s and ``rank``'s configuration: the one ``serve`` passed whole, else the flags'."""
    if args.config_json:
        return ServerConfig.from_json(args.config_json)
    config = ServerConfig.from_args(args)
    api_keys_file = config.api_keys_file.expanduser().resolve() if config.api_keys_file else None
    return replace(config, base_models=resolved_base_models(list(config.base_models)), api_keys_file=api_keys_file)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("serve", "rank"):
        config = server_config(args)
        try:
            check_host(config.host, load_api_keys(config.api_keys_file))
        except ValueError as e:
            parser.error(str(e))
    if args.command == "serve":
        return serve(args.world_size, config)
    if args.command == "demo":
        return _demo(args)
    if args.command == "rl-demo":
        return _rl_demo(args)
    if args.command == "recipes-demo":
        return _recipes_demo(args)
    from local_ranks.ranks import exit_rank

    from .server import run_rank

    code = run_rank(config)
    exit_rank(code)  # a rank that stopped cleanly skips interpreter teardown


if __name__ == "__main__":
    sys.exit(main())
