"""The server under the standard launchers: 2 CPU ranks, rank 0 serves, rank 1 follows.

The same entry point (``python -m deepspeed_tinker rank``) runs under ``torchrun`` and
DeepSpeed's ``deepspeed`` launcher on any number of nodes; here each starts 2 gloo ranks on one node
(the deepspeed launcher on DeepSpeed's CPU accelerator, which counts LOCAL_SIZE devices), the SDK
trains a step and samples, and the server stops cleanly when rank 0 gets SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tinker_sdk_helpers import require

tinker = require("tinker")
from tinker import types  # noqa: E402
from tinker_sdk_helpers import API_KEY, RESULT_TIMEOUT_S, START_TIMEOUT_S, adam, random_data, to_sdk  # noqa: E402

from local_ranks.procs import kill_tree  # noqa: E402
from local_ranks.ranks import free_port  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")


LAUNCHERS = {
    "torchrun": ["torchrun", "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                 "--master-port", "{port}", "-m"],
    "deepspeed": ["deepspeed", "--num_gpus", "2", "--master_port", "{port}", "--module"],
}


@pytest.mark.parametrize("launcher_name", sorted(LAUNCHERS))
def test_a_standard_launcher_runs_the_server_and_rank_0_serves(tmp_path: Path, launcher_name: str) -> None:
    program = Path(sys.executable).with_name(launcher_name)
    if not program.exists():
        pytest.skip(f"{launcher_name} is not installed beside this Python")
    ready, log = tmp_path / "ready.json", tmp_path / f"{launcher_name}.log"
    port = str(free_port())
    command = [str(program), *(a.replace("{port}", port) for a in LAUNCHERS[launcher_name][1:]),
               "deepspeed_tinker", "rank", "--port", "0", "--zero-stage", "1", "--device", "cpu",
               "--checkpoint-dir", str(tmp_path / "ckpt"), "--long-poll-s", "1", "--ready-file", str(ready)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", LOCAL_SIZE="2")
    with open(log, "wb") as out:
        launcher = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            assert launcher.poll() is None, f"torchrun exited with {launcher.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no server after {START_TIMEOUT_S} s:\n{log.read_text()}"
            time.sleep(0.2)
        served = json.loads(ready.read_text())

        service = tinker.ServiceClient(base_url=served["base_url"], api_key=API_KEY)
        training = service.create_lora_training_client(base_model="tiny-llama-byte", rank=4, seed=0).result(
            timeout=120)
        futures = [training.forward_backward(to_sdk(random_data(np.random.default_rng(i), 3)),
                                             "cross_entropy") for i in range(2)]
        metrics = training.optim_step(types.AdamParams(**adam())).result(timeout=RESULT_TIMEOUT_S).metrics
        assert [f.result(timeout=RESULT_TIMEOUT_S).metrics["loss:sum"] > 0 for f in futures] == [True, True]
        assert metrics["fwdbwd_requests:sum"] == 2 and metrics["datums:sum"] == 6
        sampler = training.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
        result = sampler.sample(types.ModelInput.from_ints(list(b"hi")), 3,
                                types.SamplingParams(max_tokens=4, seed=1)).result(timeout=RESULT_TIMEOUT_S)
        assert [len(s.tokens) for s in result.sequences] == [4, 4, 4]  # rank 0 sampled 2, rank 1 sampled 1
        service.close("success").result(timeout=30)

        os.kill(served["pid"], signal.SIGTERM)  # rank 0 stops the followers; the launcher sees every rank exit 0
        assert launcher.wait(120) == 0, log.read_text()
        assert "[tinker-server] stopped" in log.read_text()
    finally:
        if launcher.poll() is None:
            kill_tree(launcher.pid)
            launcher.wait()
