"""ucx: one-sided WRITE/READ into a remote agent's registered DRAM/VRAM, as a package of data paths.

- ``backend``: ``UcxBackend``, which chooses a data path per request and owns the agent-facing verbs.
- ``service``: the service thread (one loop owns the UCX worker and every control socket).
- ``protocol``: the control protocol's frames; ``messages`` its typed messages (frozen dataclasses parsed
  strictly off the wire); ``outbound`` and ``serving`` its two sides (initiator, target), each a dispatch table
  keyed by message class.
- data paths: ``one_sided`` (UCP put/get on the target's rkeys), ``direct_cma`` (process_vm_readv/writev to a
  same-host peer), ``tagged`` (tag send/recv served by the owner).
- ``rma`` (ctypes bindings of UCP RMA), ``cma`` (cross-memory attach), ``address`` (UCX worker addresses parsed
  before UCX sees them), ``config`` (UCX settings and probes), ``state`` (peers, connections, requests).
"""

from .backend import UcxBackend
from .config import (
    import_ucxx,
    make_context,
    parse_rkeys,
    probe_transports,
    tls_includes,
    transports_in_use,
    transports_of,
    ucx_config,
)

__all__ = [
    "UcxBackend",
    "import_ucxx",
    "make_context",
    "parse_rkeys",
    "probe_transports",
    "tls_includes",
    "transports_in_use",
    "transports_of",
    "ucx_config",
]
