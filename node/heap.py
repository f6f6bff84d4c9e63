"""The daemon's garbage collector, set once start-up is done.

Start-up builds a heap that lives as long as the daemon (modules, the app and its
routes, the inventory, the API reference). Left in the collector's sight, every full
collection walks all of it again, and a young collection ran every 700 allocations:
under a load of no-op submissions the collector took about a fifth of the daemon's
CPU. Refcounting frees everything acyclic at once either way; only cyclic garbage
waits for a collection.
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG_THRESHOLD", "settle_heap"]

# Allocations between young collections (Python's default is 700): a batch of
# submissions allocates in bursts, and cyclic garbage waits at most this much longer.
YOUNG_THRESHOLD = 10_000


def settle_heap() -> None:
    """Collect once, move every object that survives out of the collector's sight (it
    lives until exit), and collect young objects less often."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
