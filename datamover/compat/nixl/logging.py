"""``nixl.logging``: NIXL's logging setup (a "nixl" logger on stdout, NIXL_LOG_LEVEL) and ``get_logger``."""

from __future__ import annotations

import logging
import logging.config
import os

_configured = False

LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "simpleFormatter": {
            "format": "%(asctime)s NIXL %(levelname)-7s %(filename)s:%(lineno)d %(message)s",
            "datefmt": "%Y-%m-%d %H:%M:%S",
        }
    },
    "handlers": {
        "consoleHandler": {
            "class": "logging.StreamHandler",
            "level": "INFO",
            "formatter": "simpleFormatter",
            "stream": "ext://sys.stdout",
        }
    },
    "loggers": {"nixl": {"level": "INFO", "handlers": ["consoleHandler"], "propagate": False}},
}
_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}


def set_log_level_by_env(nixl_logger: logging.Logger) -> None:
    """Apply NIXL_LOG_LEVEL (TRACE, DEBUG, INFO, WARN, ERROR, FATAL) to the "nixl" logger."""
    level = os.getenv("NIXL_LOG_LEVEL")
    if not level:
        return
    numeric = _LEVELS.get(level.upper())
    if numeric is None:
        nixl_logger.warning("Invalid NIXL_LOG_LEVEL value '%s'. Using configuration default.", level)
        return
    nixl_logger.setLevel(numeric)


def setup_logging() -> None:
    """Configure the "nixl" logger once per process, as NIXL does."""
    global _configured
    if _configured:
        return
    logging.config.dictConfig(LOGGING_CONFIG)
    set_log_level_by_env(logging.getLogger("nixl"))
    logging.raiseExceptions = os.getenv("NIXL_DEBUG_LOGGING", "").lower() in ("true", "1", "yes")
    _configured = True


def get_logger(name: str) -> logging.Logger:
    """A logger under "nixl" ("_api" -> "nixl.api", "__main__" -> "nixl.main")."""
    setup_logging()
    return logging.getLogger(f"nixl.{name.lstrip('_')}")


__all__ = ["get_logger", "set_log_level_by_env", "setup_logging"]
