"""Serving the app with Hypercorn inside the daemon's nursery."""

from __future__ import annotations

import logging
import math

import hypercorn.config
import hypercorn.trio
import trio
from quart_trio import QuartTrio

from api.asgi_close import ShieldFinalSend
from api.settings import HttpSettings

__all__ = ["hypercorn_config", "serve_http"]


def hypercorn_config(http: HttpSettings) -> hypercorn.config.Config:
    config = hypercorn.config.Config()
    config.bind = [http.listen]
    config.accesslog = None
    # Hypercorn's messages go through the daemon's own log handlers and format.
    config.errorlog = logging.getLogger("hypercorn.error")
    # A slow or idle client cannot hold a connection forever.
    config.read_timeout = math.ceil(http.read_timeout)
    config.keep_alive_timeout = http.keep_alive
    config.graceful_timeout = 3
    config.h11_max_incomplete_size = 16 * 1024
    config.startup_timeout = 10
    config.shutdown_timeout = 10
    return config


async def serve_http(
    app: QuartTrio,
    http: HttpSettings,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `shutdown` is set; `task_status` gets the bound addresses."""
    await hypercorn.trio.serve(
        ShieldFinalSend(app),  # type: ignore[arg-type]
        hypercorn_config(http),
        shutdown_trigger=shutdown.wait,
        task_status=task_status,
    )
