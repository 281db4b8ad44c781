"""The command line loses no option: ``serve`` passes every server option to its ranks, and each demo passes every
server option it was given to its server, but the few the demo decides. No ranks: the arguments each passes on are
parsed back with the command line's own parser."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tinker_sdk_helpers import require

require("fastapi")
from deepspeed_tinker.__main__ import _demo_server, _rank_args, _server_options, build_parser  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")

DEMOS = ("demo", "rl-demo", "recipes-demo")
#: What a demo decides for its server, whatever the command line says (``_demo_server``).
DECIDED_BY_THE_DEMO = {"checkpoint_dir", "api_keys_file", "no_access_log", "base_model"}


def server_option_names() -> set[str]:
    parser = argparse.ArgumentParser()
    _server_options(parser)
    return {action.dest for action in parser._actions if action.dest != "help"}


def non_default_options(tmp_path: Path) -> list[str]:
    """A value other than the default for every server option."""
    keys = tmp_path / "keys"
    keys.write_text("tml-operator\n")
    return ["--zero-stage", "3", "--checkpoint-dir", str(tmp_path / "ckpt"), "--max-chunk-datums", "5",
            "--no-compress", "--long-poll-s", "2.5", "--base-model", f"tiny={tmp_path / 'tiny'}", "--device", "cuda",
            "--dtype", "bf16", "--gradient-checkpointing", "--keep-checkpoints", "3", "--max-body-bytes", "1000",
            "--no-access-log", "--max-futures", "7", "--max-futures-per-session", "3", "--future-ttl-s", "9.5",
            "--retrieved-grace-s", "1.5", "--threads-per-rank", "1",
            "--session-timeout-s", "30", "--api-keys-file", str(keys), "--fault-drain-s", "4", "--peer-timeout-s",
            "6", "--sampler-snapshots", "2", "--sampler-snapshot-mib", "64"]


def test_serve_passes_every_server_option_to_its_ranks(tmp_path: Path) -> None:
    parser = build_parser()
    given = parser.parse_args(["serve", "--port", "0", "--host", "127.0.0.1", *non_default_options(tmp_path)])
    default = parser.parse_args(["rank"])
    ranks = parser.parse_args(["rank", *_rank_args(given)])
    for name in server_option_names() | {"port", "host"}:
        assert getattr(ranks, name) == getattr(given, name), name
    for name in server_option_names():  # the test covers every option
        assert getattr(given, name) != getattr(default, name), f"give --{name.replace('_', '-')} a value here"


@pytest.mark.parametrize("demo", DEMOS)
def test_a_demo_passes_every_server_option_it_was_given(tmp_path: Path, demo: str) -> None:
    parser = build_parser()
    given = parser.parse_args([demo, *non_default_options(tmp_path)])
    extra_models = ("Qwen/Qwen3-8B=/models/qwen3", ) if demo == "recipes-demo" else ()
    server, client_env = _demo_server(given, tmp_path / demo, *extra_models)
    served = parser.parse_args(server.args)
    for name in server_option_names() - DECIDED_BY_THE_DEMO:
        assert getattr(served, name) == getattr(given, name), name
    assert served.checkpoint_dir == tmp_path / demo
    assert served.base_model == [f"tiny={(tmp_path / 'tiny').resolve()}", *extra_models]
    assert served.no_access_log
    assert served.api_keys_file.read_text().split() == [client_env["TINKER_API_KEY"]]  # a fresh key, the client's


def test_what_a_demo_decides(tmp_path: Path) -> None:
    parser = build_parser()
    server, _ = _demo_server(parser.parse_args(["rl-demo"]), tmp_path / "a")
    served = parser.parse_args(server.args)
    assert served.device == "cpu" and served.no_access_log and served.max_chunk_datums == 32
    server, _ = _demo_server(parser.parse_args(["demo", "--access-log"]), tmp_path / "b")
    served = parser.parse_args(server.args)
    assert not served.no_access_log and served.max_chunk_datums == 8  # the SFT demo's chunks show the SDK splitting
