"""The one native piece: datamover.backends.ucx._ucp (UCP rows and progress in C, the GIL released).

Everything else is in pyproject.toml. The extension is optional: where it cannot be built (no C compiler)
the install goes on and the ucx backend uses its ctypes path (``datamover info`` says which is active).
The build records the sha256 of _ucp.c, so a checkout whose _ucp.c changed after the build is told apart.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "datamover/backends/ucx/_ucp.c"
SOURCE_SHA256 = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()

setup(
    ext_modules=[
        Extension(
            "datamover.backends.ucx._ucp",
            [SOURCE],
            define_macros=[("DM_UCP_SOURCE_SHA256", f'"{SOURCE_SHA256}"')],
            extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE", "-Wall"],
            libraries=["dl", "pthread"],
            optional=True,
        )
    ]
)
