"""`litegraph-node logs ID [-f] [--stream stderr]`: print one stream of an invocation's
output as the node keeps it; with -f, keep printing until its output is complete."""

from __future__ import annotations

import sys
from typing import BinaryIO

import httpx

from api.run_client import BROKEN_PIPE_EXIT, LogsLost, OutputClosed, follow_log

__all__ = ["print_logs"]

REQUEST_SECONDS = 15.0


async def print_logs(
    base_url: str,
    secret: str,
    invocation_id: str,
    stream: str,
    *,
    follow: bool,
    out: BinaryIO | None = None,
    err: BinaryIO | None = None,
) -> int:
    out = out or sys.stdout.buffer
    err = err or sys.stderr.buffer
    headers = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=REQUEST_SECONDS
    ) as client:
        try:
            await follow_log(client, invocation_id, stream, out, follow=follow)
        except OutputClosed:
            return BROKEN_PIPE_EXIT
        except LogsLost as lost:
            err.write(f"litegraph-node logs: {invocation_id}: {lost}\n".encode())
            err.flush()
            return 1
    return 0
