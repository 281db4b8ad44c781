"""The command line loses no option: every server option lands in the one ``ServerConfig``, which ``serve`` passes
to its ranks whole and each demo passes to its server, but the few the demo decides. No ranks: the configuration
each passes on is read back as the ranks read it."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
from tinker_sdk_helpers import require

require("fastapi")
from deepspeed_tinker.__main__ import _demo_server, _server_options, build_parser, server_config  # noqa: E402
from deepspeed_tinker.config import ServerConfig  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")

DEMOS = ("demo", "rl-demo", "recipes-demo")
#: What a demo decides for its server, whatever the command line says (``_demo_server``).
DECIDED_BY_THE_DEMO = {"port", "checkpoint_root", "api_keys_file", "access_log", "base_models", "device"}


#: The ``ServerConfig`` field of each option whose name differs from its flag's.
FIELD_OF_OPTION = {"checkpoint_dir": "checkpoint_root", "no_compress": "compress_fwdbwd", "base_model": "base_models",
                   "no_access_log": "access_log", "sampler_snapshot_mib": "sampler_snapshot_bytes"}


def server_option_names() -> set[str]:
    parser = argparse.ArgumentParser()
    _server_options(parser)
    return {action.dest for action in parser._actions if action.dest != "help"}


def non_default_options(tmp_path: Path) -> list[list[str]]:
    """A value other than the default for every server option, one option each."""
    keys = tmp_path / "keys"
    keys.write_text("tml-operator\n")
    return [["--zero-stage", "3"], ["--checkpoint-dir", str(tmp_path / "ckpt")], ["--max-chunk-datums", "5"],
            ["--no-compress"], ["--long-poll-s", "2.5"], ["--base-model", f"tiny={tmp_path / 'tiny'}"],
            ["--device", "cuda"], ["--dtype", "bf16"], ["--gradient-checkpointing"], ["--keep-checkpoints", "3"],
            ["--max-body-bytes", "1000"], ["--no-access-log"], ["--max-futures", "7"],
            ["--max-futures-per-session", "3"], ["--future-ttl-s", "9.5"], ["--retrieved-grace-s", "1.5"],
            ["--threads-per-rank", "1"], ["--session-timeout-s", "30"], ["--api-keys-file", str(keys)],
            ["--fault-drain-s", "4"], ["--peer-timeout-s", "6"], ["--sampler-snapshots", "2"],
            ["--sampler-snapshot-mib", "64"], ["--sampler", "vllm"], ["--vllm-python", "/opt/vllm/bin/python"],
            ["--vllm-url", "http://127.0.0.1:9"], ["--vllm-adapters", "3"], ["--vllm-max-lora-rank", "8"],
            ["--vllm-threads", "2"]]


def test_every_server_option_reaches_the_configuration(tmp_path: Path) -> None:
    parser = build_parser()
    options = non_default_options(tmp_path)
    assert {option[0][2:].replace("-", "_") for option in options} == server_option_names(), "cover every option"
    for option in options:
        dest = option[0][2:].replace("-", "_")
        # --sampler vllm needs one --base-model: both configurations have it, so the sampler alone differs.
        given = ["--base-model", str(tmp_path / "m")] if dest == "sampler" else []
        default = server_config(parser.parse_args(["rank", *given]))
        changed = server_config(parser.parse_args(["rank", *given, *option]))
        differing = [f.name for f in dataclasses.fields(ServerConfig)
                     if getattr(changed, f.name) != getattr(default, f.name)]
        assert differing == [FIELD_OF_OPTION.get(dest, dest)], f"{option[0]} changes exactly its field: {differing}"


def test_serve_passes_its_configuration_to_the_ranks_whole(tmp_path: Path) -> None:
    parser = build_parser()
    flags = [flag for option in non_default_options(tmp_path) for flag in option]
    given = server_config(parser.parse_args(["serve", "--port", "0", "--host", "127.0.0.1", *flags]))
    assert given.port == 0 and given.zero_stage == 3 and given.sampler_snapshot_bytes == 64 << 20
    assert given.base_models == (f"tiny={(tmp_path / 'tiny').resolve()}", ), "paths made absolute once"
    ranks = server_config(parser.parse_args(["rank", "--config-json", given.to_json()]))
    assert ranks == given
    assert json.loads(given.to_json())["checkpoint_root"] == str(tmp_path / "ckpt")


@pytest.mark.parametrize("demo", DEMOS)
def test_a_demo_passes_every_server_option_it_was_given(tmp_path: Path, demo: str) -> None:
    parser = build_parser()
    # The recipes demo serves two models, which --sampler vllm refuses (the test below): it runs the ranks' sampler.
    flags = [flag for option in non_default_options(tmp_path) for flag in option
             if not (demo == "recipes-demo" and option[0] == "--sampler")]
    given = parser.parse_args([demo, *flags])
    extra_models = ("Qwen/Qwen3-8B=/models/qwen3", ) if demo == "recipes-demo" else ()
    server, client_env = _demo_server(given, tmp_path / demo, *extra_models)
    served = ServerConfig.from_json(server.config.to_json())
    expected = ServerConfig.from_args(given)
    for field in dataclasses.fields(ServerConfig):
        if field.name not in DECIDED_BY_THE_DEMO:
            assert getattr(served, field.name) == getattr(expected, field.name), field.name
    assert served.checkpoint_root == tmp_path / demo and served.port == 0
    assert served.base_models == (f"tiny={(tmp_path / 'tiny').resolve()}", *extra_models)
    assert served.device == "cuda" and not served.access_log
    assert served.api_keys_file.read_text().split() == [client_env["TINKER_API_KEY"]]  # a fresh key, the client's


def test_what_a_demo_decides(tmp_path: Path) -> None:
    parser = build_parser()
    server, _ = _demo_server(parser.parse_args(["rl-demo"]), tmp_path / "a")
    assert server.config.device == "cpu" and not server.config.access_log and server.config.max_chunk_datums == 32
    server, _ = _demo_server(parser.parse_args(["demo", "--access-log"]), tmp_path / "b")
    assert server.config.access_log and server.config.max_chunk_datums == 8  # the SFT demo's chunks show the split


def test_the_vllm_sampler_without_exactly_one_base_model_is_refused_before_any_rank_starts() -> None:
    parser = build_parser()
    for base_models in ([], ["--base-model", "/a", "--base-model", "/b"]):
        with pytest.raises(SystemExit, match="--sampler vllm serves exactly one --base-model"):
            server_config(parser.parse_args(["serve", "--sampler", "vllm", *base_models]))
