"""Metadata exchange through etcd: publish under a kept-alive lease, fetch with a watch.

An agent's blob lives at ``/<namespace>/agents/<name>``, attached to a lease with a short TTL that the publisher
keeps alive; when the agent dies the lease expires, etcd deletes the key, and peers watching it drop the agent. One
job per module: ``publisher`` (``EtcdPublisher``: the lease and the puts), ``watch`` (``fetch``, ``EtcdWatch``:
reading a peer's key and keeping it current), ``gateway`` (the client, the agents' keys, every call and read of the
v3 JSON gateway bounded) and ``answers`` (the gateway's JSON answers parsed: garbage is InvalidMetadata naming the
key).
"""

from .answers import kv_value, parse_range, watch_events
from .gateway import MAX_WATCH_LINE, agent_key, connect, gateway_call, read_key, read_range, split_lines
from .publisher import CLOSE_TIMEOUT_S, EtcdPublisher
from .watch import EtcdWatch, fetch

__all__ = [
    "CLOSE_TIMEOUT_S",
    "MAX_WATCH_LINE",
    "EtcdPublisher",
    "EtcdWatch",
    "agent_key",
    "connect",
    "fetch",
    "gateway_call",
    "kv_value",
    "parse_range",
    "read_key",
    "read_range",
    "split_lines",
    "watch_events",
]
