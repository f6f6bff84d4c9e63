"""A sandboxed guest lives as long as its work, however idle the daemon is meanwhile."""

from __future__ import annotations

import pathlib

import pytest
import trio._core._thread_cache as thread_cache

from tests.confinement.guests import confined_node, python, run_to_end


async def test_a_guest_outlives_the_thread_that_happened_to_start_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bwrap's --die-with-parent follows the forking *thread*; trio's worker threads
    # retire after IDLE_TIMEOUT idle seconds (10). Shortened here so the test is quick.
    monkeypatch.setattr(thread_cache, "IDLE_TIMEOUT", 0.2)
    async with confined_node(tmp_path) as node:
        found = await run_to_end(node, python("import time; time.sleep(2); print('done')"))
        assert (found["state"], found["stdout_tail"]) == ("succeeded", "done\n"), found
