"""ds_series.cpu_info: py-cpuinfo's subprocess runs once per process, every caller gets its own dict of the answer."""

from __future__ import annotations

import importlib
import json

import cpuinfo
import pytest

from ds_series.cpu_info import ask_cpu_info_once

MODULE = importlib.import_module("cpuinfo.cpuinfo")


def counting(answer, calls: list):
    def get_cpu_info_json() -> str:
        calls.append(1)
        return answer()

    return get_cpu_info_json


def test_cpu_info_is_asked_once_and_each_caller_gets_its_own_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list = []
    monkeypatch.setattr(MODULE, "get_cpu_info_json", counting(lambda: '{"arch": "X86_64", "flags": ["avx2"]}', calls))
    bound_before = cpuinfo.get_cpu_info  # as a module that imported it before the harness ran holds it
    ask_cpu_info_once()
    assert calls == []  # nothing asked until someone asks
    first = bound_before()
    first["flags"].append("changed by a caller")
    second = cpuinfo.get_cpu_info()
    ask_cpu_info_once(now=True)  # the answer is kept once, not wrapped again
    assert calls == [1]
    assert second == {"arch": "X86_64", "flags": ["avx2"]}


def test_deepspeeds_cpu_adam_asks_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two DeepSpeed CPU Adams (and their op's build arguments, at its first load here) ask py-cpuinfo once between
    them and read its answer."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    calls: list = []
    real = MODULE.get_cpu_info_json
    monkeypatch.setattr(MODULE, "get_cpu_info_json",
                        counting(lambda: json.dumps({**json.loads(real()), "vendor_id_raw": "GenuineTest"}), calls))
    ask_cpu_info_once()
    optimizers = [DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))]) for _ in range(2)]
    assert calls == [1]
    assert [o.cpu_vendor for o in optimizers] == ["genuinetest", "genuinetest"]
