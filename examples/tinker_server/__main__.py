"""Command line: ``python -m examples.tinker_server {serve,demo,rank}`` from the repository root."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .launch import ROOT, ServerProcess, serve

DEFAULT_CHECKPOINTS = ROOT / "scratch" / "tinker_checkpoints"


def _server_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=1)
    parser.add_argument("--checkpoint-dir", type=Path, default=DEFAULT_CHECKPOINTS,
                        help="where save_weights writes (default: %(default)s)")
    parser.add_argument("--max-chunk-datums", type=int, default=8,
                        help="datums per forward_backward chunk the SDK is told to send")
    parser.add_argument("--no-compress", action="store_true", help="do not ask the SDK to zstd request bodies")
    parser.add_argument("--long-poll-s", type=float, default=10.0,
                        help="how long retrieve_future holds a pending request before answering try_again")


def _rank_args(args: argparse.Namespace) -> list[str]:
    out = ["--port", str(args.port), "--zero-stage", str(args.zero_stage), "--checkpoint-dir",
           str(args.checkpoint_dir), "--max-chunk-datums", str(args.max_chunk_datums), "--long-poll-s",
           str(args.long_poll_s)]
    if args.no_compress:
        out.append("--no-compress")
    if args.ready_file:
        out += ["--ready-file", str(args.ready_file)]
    return out


def _demo(args: argparse.Namespace) -> int:
    """Start a server on ``--world-size`` CPU ranks, run the SFT client against it, stop the server."""
    checkpoints = args.checkpoint_dir / "demo"
    server = ServerProcess(world_size=args.world_size, zero_stage=args.zero_stage, checkpoint_dir=checkpoints,
                           extra_args=["--max-chunk-datums", "8"])
    print(f"[demo] starting the server on {args.world_size} CPU ranks (ZeRO stage {args.zero_stage})", flush=True)
    base_url = server.start()
    try:
        client = [args.client_python, str(Path(__file__).with_name("sft_client.py")), "--base-url", base_url,
                  "--rank", str(args.rank), "--steps", str(args.steps)]
        return subprocess.run(client, cwd=ROOT, timeout=args.timeout_s).returncode
    finally:
        code = server.stop()
        print(f"[demo] server stopped (exit code {code})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.tinker_server",
                                     description="A Tinker-protocol training server on DeepSpeed (unmanaged mode).")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_cmd = commands.add_parser("serve", help="serve on 127.0.0.1 from W CPU ranks until SIGTERM/SIGINT")
    serve_cmd.add_argument("--world-size", type=int, default=2)
    serve_cmd.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve_cmd.add_argument("--ready-file", type=Path, help="rank 0 writes {base_url, pid} here once serving")
    _server_options(serve_cmd)

    demo_cmd = commands.add_parser("demo", help="server on 2 CPU ranks + the SDK's SFT client, then stop")
    demo_cmd.add_argument("--world-size", type=int, default=2)
    demo_cmd.add_argument("--steps", type=int, default=8)
    demo_cmd.add_argument("--rank", type=int, default=16, help="LoRA rank; 0 for full fine-tuning")
    demo_cmd.add_argument("--client-python", default=sys.executable,
                          help="Python that has the tinker SDK (default: this one)")
    demo_cmd.add_argument("--timeout-s", type=float, default=900)
    _server_options(demo_cmd)

    rank_cmd = commands.add_parser("rank", help="(internal) one rank; `serve` starts these")
    rank_cmd.add_argument("--port", type=int, required=True)
    rank_cmd.add_argument("--ready-file", type=Path)
    _server_options(rank_cmd)

    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args.world_size, _rank_args(args))
    if args.command == "demo":
        return _demo(args)
    from .server import RankOptions, run_rank

    code = run_rank(RankOptions(port=args.port, zero_stage=args.zero_stage, checkpoint_root=args.checkpoint_dir,
                                ready_file=args.ready_file, max_chunk_datums=args.max_chunk_datums,
                                compress_fwdbwd=not args.no_compress, long_poll_s=args.long_poll_s))
    # A rank that stopped cleanly exits without interpreter teardown: C++ threads left by the libraries
    # (seen with ZeRO-3) abort the process ("terminate called without an active exception") otherwise.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
