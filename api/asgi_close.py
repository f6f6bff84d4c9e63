"""Let Hypercorn finish closing a connection after the last response byte.

After the final body chunk of a response to a client that is still sending
its request body, Hypercorn closes the connection from inside the app's
`send` call -- after handing the app `http.disconnect`. Quart-trio's message
reader takes that disconnect and cancels the request's nursery, so the close
is cancelled half-way and the socket stays open for as long as the client
keeps dripping bytes. Shielding the final `send` (with its own deadline)
lets the close complete.
"""

from __future__ import annotations

from typing import Any

import trio

__all__ = ["ShieldFinalSend"]

Scope = dict[str, Any]
Message = dict[str, Any]


class ShieldFinalSend:
    def __init__(self, app: Any, *, deadline: float = 10.0) -> None:
        self.app = app
        self.deadline = deadline

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def shielded_final_send(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                with trio.move_on_after(self.deadline, shield=True):
                    await send(message)
                return
            await send(message)

        await self.app(scope, receive, shielded_final_send)
