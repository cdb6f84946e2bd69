"""Facts about other processes of this machine that any layer may ask (imports nothing of datamover)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists, another user's included (a copy into a dying peer can fail with EFAULT
    before ESRCH; a killed run's leftovers are named by their owner's pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
