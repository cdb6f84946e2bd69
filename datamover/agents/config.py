"""AgentConfig: which backends an agent runs, with what parameters, and its limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import InvalidParameter, UnknownBackend, shown

#: the longest transfer timeout taken (a year): past it, waits on a lock overflow the platform's timeout
MAX_TIMEOUT_S = 365 * 86400.0


@dataclass
class AgentConfig:
    """Settings of one Agent; a plain dict of the same shape is accepted too.

    ``backends`` maps backend names to their parameters, in preference order;
    None enables every backend usable here with default parameters.
    ``timeout_s`` bounds every transfer from post to completion.
    """

    backends: dict[str, dict[str, Any]] | None = None
    timeout_s: float = 30.0
    secret: bytes | None = None
    listen_port: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_any(cls, config: AgentConfig | Mapping[str, Any] | None) -> AgentConfig:
        """Accept an AgentConfig, a dict of its fields, or None (defaults)."""
        if config is None:
            return cls()
        if isinstance(config, AgentConfig):
            return config
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be an AgentConfig or a dict, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(config) - known
        if unknown:
            raise InvalidParameter(f"unknown config key(s) {sorted(unknown)}; known: {', '.join(sorted(known))}")
        cfg = cls(**dict(config))
        cfg.validate()
        return cfg

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.backends is not None:
            if isinstance(self.backends, (list, tuple)):
                self.backends = {name: {} for name in self.backends}
            if not isinstance(self.backends, Mapping):
                raise InvalidParameter("config 'backends' must map backend names to parameter dicts")
            for name, params in self.backends.items():
                if params is None:
                    self.backends[name] = {}
                elif not isinstance(params, Mapping):
                    raise InvalidParameter(f"config 'backends.{name}' must be a dict of parameters")
            from ..backends import backend_names

            known = backend_names()
            unknown = [name for name in self.backends if name not in known]
            if unknown:
                raise UnknownBackend(
                    f"config 'backends' names {', '.join(map(repr, unknown))}, which no installed backend is; "
                    f"known: {', '.join(known)}"
                )
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and 0 < timeout <= MAX_TIMEOUT_S):
            raise InvalidParameter(
                f"config 'timeout_s' must be a number of seconds in (0, a year], got {shown(timeout)}"
            )
        _check_extra(self.extra)
        if isinstance(self.secret, str):
            self.secret = self.secret.encode()
        if self.secret is not None and not isinstance(self.secret, (bytes, bytearray)):
            raise InvalidParameter(f"config 'secret' must be bytes or a string, got {type(self.secret).__name__}")
        port = self.listen_port
        if isinstance(port, str) and port.strip().isdecimal():  # a port read from an environment variable
            port = int(port)
        if port is not None and (type(port) is not int or not 0 <= port < 65536):
            raise InvalidParameter(f"config 'listen_port' must be an integer 0..65535, got {shown(self.listen_port)}")
        self.listen_port = port


def _check_extra(extra: Any) -> None:
    """Refuse an ``extra`` section this agent would not read, or a name its section does not have (a misspelt
    limit was ignored, or failed later with a TypeError from deep inside)."""
    from .notifications import InboxLimits
    from .peer_auth import PushBudget
    from .side_channel import SideChannelLimits

    sections = {"inbox": InboxLimits, "push_budget": PushBudget, "side_channel": SideChannelLimits}
    if not isinstance(extra, Mapping):
        raise InvalidParameter(f"config 'extra' must be a dict, got {type(extra).__name__}")
    unknown = set(extra) - set(sections) - {"listen_host"}
    if unknown:
        raise InvalidParameter(
            f"config 'extra' has unknown section(s) {sorted(unknown)}; known: {', '.join([*sections, 'listen_host'])}"
        )
    host = extra.get("listen_host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise InvalidParameter(f"config extra 'listen_host' must be a host name or address, got {shown(host)}")
    for name, cls in sections.items():
        values = extra.get(name, {})
        known = [f.name for f in fields(cls) if f.init]
        if not isinstance(values, Mapping) or set(values) - set(known):
            raise InvalidParameter(f"config extra '{name}' takes {', '.join(known)}, got {shown(values)}")
        cls(**values)  # each section checks its own values (InvalidParameter naming the limit)
