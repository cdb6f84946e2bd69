"""gds: VRAM/DRAM <-> FILE through GPUDirect Storage (kvikio's cuFile bindings)."""

from .backend import GdsBackend

__all__ = ["GdsBackend"]
