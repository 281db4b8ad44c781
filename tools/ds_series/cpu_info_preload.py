"""Imported once in the forkserver of upstream's test harness (``ds_series.upstream_tests``' preload list): py-cpuinfo
is asked there, and every rank forked from it keeps the answer (``ds_series.cpu_info``)."""

from .cpu_info import ask_cpu_info_once

ask_cpu_info_once(now=True)
