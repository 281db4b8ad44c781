"""How the suite is spread over pytest-xdist workers (``tools/test.sh`` runs ``--dist loadfile``).

``loadfile`` sends each test file to one worker, so a file's module fixtures (a server, a reference run) are set up
once. A folder whose files share session fixtures that are expensive to set up goes to one worker whole instead:
pytest orders its tests by those fixtures' parameters across the files, and each instance is set up once per run,
not once per file. The Tinker server tests on one 2-rank server per ZeRO stage (``tests/tinker_server/
session_servers``) are such a folder: their 32 server starts, 10-20 s each on 2 cores, become 4.
"""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadFileScheduling


def unit_of(nodeid: str, folders: tuple[str, ...]) -> str:
    """The unit of work of a test: the first of ``folders`` (paths relative to the rootdir, ``/``-terminated) it lies
    under, else its file."""
    for folder in folders:
        if nodeid.startswith(folder):
            return folder
    return nodeid.split("::", 1)[0]


class FolderOrFileScheduling(LoadFileScheduling):
    """``loadfile``, except that a test under one of ``folders`` has its folder as its unit of work."""

    def __init__(self, config: pytest.Config, log: Any = None, folders: tuple[str, ...] = ()) -> None:
        super().__init__(config, log)
        self.folders = folders

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid, self.folders)
