"""Lane-work routing: a token holder's request reaches its lane's owner, bounded by
the lane-work deadline; tokens are checked against their holder and refreshed."""

from __future__ import annotations

from collections.abc import Callable

import trio

from capabilities import Claims, LaneOp, MintedToken, TokenRefusal, TokenRefused
from capabilities.errors import MintError, RevocationFull
from supervisor.hold import Hold
from supervisor.lane_owner import LaneOwner, LaneWorkError
from supervisor.lane_work import Download, LaneJob, LaneWorkReply
from supervisor.state import SupervisorState

__all__ = ["LaneRouting"]


class LaneRouting:
    def __init__(self, state: SupervisorState) -> None:
        self._state = state

    def _owner(self, lane_id: str) -> LaneOwner:
        owner = self._state.owners.get(lane_id)
        if owner is None:
            raise LaneWorkError(404, "unknown_lane", "no such lane")
        return owner

    def lane_caller(self, lane_id: str, token: str) -> Claims:
        """Whose token this is, if it is authority on the lane for any op; the edge
        asks before it reads a request's body (TokenRefused otherwise)."""
        return self._owner(lane_id).identify(token)

    async def lane_work(self, lane_id: str, token: str, work: LaneJob) -> LaneWorkReply:
        owner = self._owner(lane_id)
        with trio.fail_after(self._state.lane_work_deadline):
            return await owner.request(token, work)

    async def lane_download(self, lane_id: str, token: str, work: Download) -> bytes:
        owner = self._owner(lane_id)
        with trio.fail_after(self._state.lane_work_deadline):
            return await owner.download(token, work)

    def check_holder(
        self, lane_id: str, token: str, op: LaneOp, peer_uid: int | None, bound: str | None
    ) -> None:
        """A guest's token works only for that guest's uid, on the Unix socket and over
        TCP alike: a token copied out of its sandbox is refused wherever else it turns
        up, and so is one whose sender's uid the kernel could not name (`peer_uid`
        None: a peer on another host, a failed lookup). Root and the daemon's own user
        are no exception: they hold the signing key and need no guest's token.

        A standing hold's token (a claim's) works only on its own socket (`bound`, the
        subject the request's socket was opened for), and nothing else's there."""
        claims = self._state.validator.validate(token, lane_id=lane_id, op=op)
        if bound is not None or claims.sub in self._state.holds:
            if claims.sub == bound and bound in self._state.holds:
                return
            raise TokenRefused(
                TokenRefusal.WRONG_HOLDER, "presented on another socket than its claim's own"
            )
        inv = self._state.live.get(claims.sub)
        if inv is None or inv.uid is None or inv.uid == peer_uid:
            return  # a builtin's token, or no uid of its own (dev): a bearer token
        said = "by a sender whose uid is not known" if peer_uid is None else f"by uid {peer_uid}"
        raise TokenRefused(TokenRefusal.WRONG_HOLDER, f"presented {said}, not its guest's")

    def refresh_token(
        self, lane_id: str, token: str, tokens_changed: Callable[[Hold], None]
    ) -> MintedToken:
        """A fresh token with the same scope for a live invocation; the old one is revoked.

        Tokens live at most `--token-ttl` (an hour at most); work that runs longer
        trades its still-valid token for a new one, up to its own deadline, once
        the token has used half its life (RefreshTooEarly before that). The new
        token replaces the old one: refreshing adds no state. A standing hold's
        new token is written where its holder reads it too (`tokens_changed`).
        """
        claims = self._state.validator.validate(token, lane_id=lane_id, op=LaneOp.EXECUTE)
        hold = self._state.holds.get(claims.sub)
        if hold is not None:
            return self._refresh_hold(hold, claims, lane_id, token, tokens_changed)
        inv = self._state.live.get(claims.sub)
        if inv is None or inv.tokens.get(lane_id) != token:
            # Ended, or this token was already traded in for a newer one.
            raise LaneWorkError(409, "token_not_current", "not the invocation's current token")
        try:
            minted = self._state.tokens.refresh(claims, deadline=inv.wall_deadline)
        except (MintError, RevocationFull) as exc:
            raise LaneWorkError(503, "token_unavailable", str(exc)) from None
        inv.tokens[lane_id] = minted.token
        return minted

    def _refresh_hold(
        self,
        hold: Hold,
        claims: Claims,
        lane_id: str,
        token: str,
        tokens_changed: Callable[[Hold], None],
    ) -> MintedToken:
        if hold.tokens.get(lane_id) != token:
            raise LaneWorkError(409, "token_not_current", "not the claim's current token")
        try:
            minted = self._state.tokens.refresh(claims, deadline=None)
        except (MintError, RevocationFull) as exc:
            raise LaneWorkError(503, "token_unavailable", str(exc)) from None
        hold.tokens[lane_id] = minted.token
        tokens_changed(hold)
        return minted
