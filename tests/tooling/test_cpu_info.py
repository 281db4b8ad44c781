"""ds_series.cpu_info: py-cpuinfo asked once per process, every caller served its own copy of the answer."""

from __future__ import annotations

import cpuinfo
import pytest

from ds_series.cpu_info import ask_cpu_info_once


def test_cpu_info_is_asked_once_and_each_caller_gets_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def asked() -> dict:
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2"]}

    monkeypatch.setattr(cpuinfo, "get_cpu_info", asked)
    ask_cpu_info_once()
    assert calls == []  # nothing asked until someone asks
    first = cpuinfo.get_cpu_info()
    first["flags"].append("changed by a caller")
    second = cpuinfo.get_cpu_info()
    ask_cpu_info_once(now=True)  # a second wrap would ask again: it does not wrap twice
    assert calls == [1]
    assert second == {"arch": "X86_64", "flags": ["avx2"]}


def test_deepspeed_reads_the_kept_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed imports ``get_cpu_info`` from the package at call time: it sees the kept answer."""
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: {"arch": "X86_64", "vendor_id_raw": "GenuineIntel"})
    ask_cpu_info_once(now=True)
    from cpuinfo import get_cpu_info

    assert get_cpu_info()["vendor_id_raw"] == "GenuineIntel"
    assert getattr(get_cpu_info, "asked_once", False)
