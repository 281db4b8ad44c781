"""The server as an operator runs it: the ``deepspeed-tinker`` console script of the environment the project is
installed in, started in a folder outside the checkout with no ``PYTHONPATH``. With its defaults it tells the SDK
the chunk size the docs give (32 datums per request, chosen by measurement), serves the official SDK, writes its
checkpoints under that folder, logs a line per HTTP request (uvicorn's access log, on by default) and one per
training step, and stops with exit code 0 on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from tinker_sdk_helpers import require

tinker = require("tinker")
from tinker import types  # noqa: E402
from tinker_sdk_helpers import API_KEY, RESULT_TIMEOUT_S, START_TIMEOUT_S, random_data, to_sdk  # noqa: E402

from local_ranks.procs import kill_tree  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")

CHECKOUT = Path(__file__).resolve().parents[2]


def wait_until_serving(process: subprocess.Popen, ready: Path, log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        assert process.poll() is None, f"exited with {process.returncode}:\n{log.read_text(errors='replace')}"
        assert time.monotonic() < deadline, f"not serving after {START_TIMEOUT_S} s:\n{log.read_text()}"
        time.sleep(0.1)
    return json.loads(ready.read_text())["base_url"]


def test_the_console_script_serves_from_outside_the_checkout(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("deepspeed-tinker")
    assert script.is_file(), f"{script}: the environment has no console script (pip install ./server installs it)"
    workdir = tmp_path / "operator"
    workdir.mkdir()
    assert CHECKOUT not in workdir.parents
    (workdir / "keys").write_text(API_KEY + "\n")
    ready, log = workdir / "ready.json", workdir / "server.log"
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    with open(log, "wb") as out:
        process = subprocess.Popen([str(script), "serve", "--world-size", "1", "--device", "cpu", "--port", "0",
                                    "--ready-file", str(ready), "--api-keys-file", "keys"], cwd=workdir, env=env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base_url = wait_until_serving(process, ready, log)
        config = urllib.request.Request(f"{base_url}/api/v1/client/config", b'{"sdk_version": "0.38.0"}',
                                        {"X-API-Key": API_KEY, "Content-Type": "application/json"})
        with urllib.request.urlopen(config, timeout=60) as answer:
            assert json.load(answer)["fwdbwd_max_chunk_len"] == 32
        service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
        training = service.create_lora_training_client(base_model="tiny-llama-byte", rank=4).result(timeout=120)
        data = to_sdk(random_data(np.random.default_rng(0), 3))
        assert training.forward_backward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S).metrics
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=RESULT_TIMEOUT_S)
        service.close("success").result(timeout=30)
        process.send_signal(signal.SIGTERM)
        code = process.wait(120)
    finally:
        kill_tree(process.pid)
    text = log.read_text(errors="replace")
    assert code == 0, text
    assert '"POST /api/v1/forward_backward HTTP/1.1" 200' in text, text
    assert re.search(r"tinker_server\.steps INFO step 1 of \S+ \(session \S+\): 1 forward_backward request\(s\), "
                     r"3 datums", text), text
    assert (workdir / "scratch" / "tinker_checkpoints").is_dir()  # the default, relative to where it started
