"""Multi-rank test harness: run a module-level test body on W real ranks.

Ranks are long-lived processes (one pool per world size) so that hundreds of
DeepSpeed engine tests do not each pay for process start, ``import torch`` and
rendezvous. A pool that saw a failure or a timeout is killed, never reused.

    from ds_harness import run_on_ranks
    results = run_on_ranks(body, 2, arg1, arg2)   # list indexed by rank
"""

from .dist import Dist
from .errors import PoolStartError, RankError, RankTimeout
from .pools import shutdown_pools
from .runner import SETTINGS, Settings, run_on_ranks

__all__ = [
    "Dist",
    "PoolStartError",
    "RankError",
    "RankTimeout",
    "SETTINGS",
    "Settings",
    "run_on_ranks",
    "shutdown_pools",
]
