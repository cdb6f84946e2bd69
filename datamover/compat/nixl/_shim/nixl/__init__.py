"""``import nixl`` resolved to datamover's NIXL facade: this folder is put first on the path only by
``datamover nixl-run``, ``python -m datamover.compat.nixl`` or ``datamover.compat.nixl.alias.install()``."""

from datamover.compat.nixl.alias import register

register()
