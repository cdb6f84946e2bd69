"""posix: DRAM <-> FILE with pread/pwrite or Linux AIO (io_submit) on O_DIRECT files."""

from .backend import PosixBackend, probe_direct

__all__ = ["PosixBackend", "probe_direct"]
