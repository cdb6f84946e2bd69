"""Who may replace or drop a peer through the side channel, and how much pushed metadata an agent keeps.

With a shared secret, blobs and DROPs are HMAC-signed (``metadata.sign_metadata``)
and any holder of the secret may replace or drop a peer. Without one, every
agent draws a private 32-byte token and publishes only its hash (``ident`` in
its metadata): a PUSH that would replace a known peer, and a DROP, must carry
the token whose hash that peer published. A client that never was that agent
cannot make this one forget it or point it elsewhere. (The token travels in
clear to the agents it is shown to; only the secret authenticates against
them.) A pushed peer is kept within ``PushBudget``.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from ..errors import AuthenticationError, RemoteRefused
from .limits import check_limits
from .metadata import AgentMetadata, agent_ident, open_metadata, sign_metadata

TOKEN_BYTES = 32


def drop_payload(name: str, token: bytes, secret: bytes | None) -> bytes:
    """What ``invalidate_at`` sends: the name, signed with the secret, else followed by the token."""
    if secret:
        return sign_metadata(name.encode(), secret)
    return name.encode() + b"\0" + token


def parse_drop(payload: bytes, secret: bytes | None) -> tuple[str, bytes | None]:
    """(name, token) of a DROP; the token is None when the secret authenticated it."""
    if secret:
        return open_metadata(payload, secret).decode(errors="replace"), None
    name, sep, token = bytes(payload).partition(b"\0")
    if not sep:
        raise AuthenticationError("DROP without the sender's identity token")
    return name.decode(errors="replace"), token


def proves(known: AgentMetadata, token: bytes | None) -> bool:
    """Whether ``token`` is the private token of the agent ``known`` describes."""
    return known.ident is not None and token is not None and hmac.compare_digest(agent_ident(token), known.ident)


def check_replacement(known: AgentMetadata | None, token: bytes | None, signed: bool) -> None:
    """Refuse a pushed blob that would replace ``known`` without the secret or ``known``'s token."""
    if known is None or signed or proves(known, token):
        return
    raise AuthenticationError(
        f"agent {known.name!r} is already known here; a PUSH replacing it must come from it (its identity token) "
        "or carry the shared secret (a restarted agent is taken once this one forgot the old: its DROP, "
        "remove_remote, or its etcd lease expiring)"
    )


@dataclass
class PushBudget:
    """Bounds on metadata pushed by peers: regions per peer (refused before they are unpacked) and bytes kept."""

    max_regions: int = 1 << 16
    max_peers: int = 256
    max_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        check_limits("push_budget", self)
        self.kept: dict[str, int] = {}

    def check(self, meta: AgentMetadata, live: set[str]) -> None:
        """Refuse ``meta`` if keeping it would pass the budget (peers no longer in ``live`` free their share)."""
        for gone in set(self.kept) - live:
            del self.kept[gone]
        others = {n: b for n, b in self.kept.items() if n != meta.name}
        if len(others) >= self.max_peers:
            raise RemoteRefused(f"this agent keeps metadata pushed by at most {self.max_peers} peers")
        if sum(others.values()) + meta.nbytes > self.max_bytes:
            raise RemoteRefused(
                f"keeping {meta.nbytes} more bytes of pushed metadata would pass this agent's budget of "
                f"{self.max_bytes} (held: {sum(others.values())})"
            )

    def kept_as(self, meta: AgentMetadata) -> None:
        self.kept[meta.name] = meta.nbytes
