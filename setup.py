"""The one native piece: datamover.backends.ucx._ucp (UCP rows and progress in C, the GIL released).

Everything else is in pyproject.toml. The extension is optional: where it cannot be built (no C compiler)
the install goes on and the ucx backend uses its ctypes path (``datamover info`` says which is active).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "datamover.backends.ucx._ucp",
            ["datamover/backends/ucx/_ucp.c"],
            extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE", "-Wall"],
            libraries=["dl", "pthread"],
            optional=True,
        )
    ]
)
