"""AgentConfig: which backends an agent runs, with what parameters, and its limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import InvalidParameter


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
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s <= 365 * 86400):
            raise InvalidParameter(
                f"config 'timeout_s' must be a number of seconds in (0, a year], got {self.timeout_s!r}"
            )
        if isinstance(self.secret, str):
            self.secret = self.secret.encode()
        if self.listen_port is not None and not (0 <= int(self.listen_port) < 65536):
            raise InvalidParameter(f"config 'listen_port' must be 0..65535, got {self.listen_port!r}")
