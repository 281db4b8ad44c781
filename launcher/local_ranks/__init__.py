"""Start W ranks of one job on this machine as ``torchrun`` would, and stop them and clean up after them.

One small package that the Tinker server, the test harness, the benchmarks and the series' tooling all use, so
installing the server installs neither the test harness nor the patch tooling: ``ranks`` (a free port, each
rank's environment, starting and leaving ranks) and ``procs`` (stopping a process tree, the shared memory ranks
leave behind).
"""
