"""Make ``import nixl`` resolve to this facade: in this process, its Python children, or a program run under it.

``register()`` aliases the modules in this process only. ``install()`` also puts
the alias folder (``SHIM_DIR``, holding a one-file ``nixl`` package) first on
``sys.path`` and ``PYTHONPATH``, so multiprocessing and subprocess children of
this process import the facade too; it refuses while a real NIXL is importable
unless ``force=True``. ``run(argv)`` replaces this process with
``python ARGV...`` under the alias (``datamover nixl-run``). Nothing here
touches site-packages, so outside those processes a real NIXL stays what
``import nixl`` finds.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from collections.abc import Sequence

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim")
_PREFIX = "datamover.compat.nixl"
ENV_FLAG = "DATAMOVER_NIXL_ALIAS"


def register() -> None:
    """Alias ``nixl`` and ``nixl.<submodule>`` to this facade in ``sys.modules`` (this process only)."""
    import datamover.compat.nixl as facade

    sys.modules["nixl"] = facade
    for name, mod in list(sys.modules.items()):
        if name.startswith(_PREFIX + ".") and "._shim" not in name and mod is not None:
            sys.modules["nixl" + name[len(_PREFIX) :]] = mod


def real_nixl() -> str | None:
    """Where a real NIXL package is importable from (ignoring this alias), else None."""
    path = [p for p in sys.path if os.path.abspath(p or ".") != SHIM_DIR]
    spec = importlib.machinery.PathFinder.find_spec("nixl", path)
    if spec is None:
        return None
    return spec.origin or (list(spec.submodule_search_locations or []) or ["?"])[0]


def is_active() -> bool:
    """Whether ``import nixl`` gives this facade in this process."""
    mod = sys.modules.get("nixl")
    return mod is not None and mod.__name__ == _PREFIX


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the alias folder first on PYTHONPATH."""
    out = dict(os.environ if env is None else env)
    parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != SHIM_DIR]
    out["PYTHONPATH"] = os.pathsep.join([SHIM_DIR, *parts])
    out[ENV_FLAG] = "1"
    return out


def install(children: bool = True, force: bool = False) -> None:
    """Make ``import nixl`` give this facade here (and, with ``children``, in child processes).

    Raises RuntimeError while a real NIXL is importable, unless ``force``.
    """
    if not is_active():
        where = real_nixl()
        if where is not None and not force:
            raise RuntimeError(
                f"a real NIXL is installed ({where}); datamover will not shadow it unless asked: install(force=True)"
            )
        register()
    if children:
        if SHIM_DIR not in sys.path:
            sys.path.insert(0, SHIM_DIR)
        os.environ.update({k: v for k, v in child_env().items() if k in ("PYTHONPATH", ENV_FLAG)})


def run(argv: Sequence[str]) -> None:
    """Replace this process with ``python ARGV...`` in which ``import nixl`` is the facade (``nixl-run``)."""
    args = list(argv)
    if not args:
        raise SystemExit("usage: datamover nixl-run PROGRAM [ARGS...]   (or: -m MODULE [ARGS...])")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], child_env())


def main(argv: Sequence[str]) -> int:
    """``datamover nixl-run PROGRAM [ARGS]``; ``--path`` prints the alias folder (for PYTHONPATH) instead."""
    args = list(argv)
    if args[:1] == ["--path"]:
        print(SHIM_DIR)
        return 0
    run(args)
    return 0
