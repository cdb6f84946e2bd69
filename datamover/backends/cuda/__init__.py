"""cuda: VRAM <-> DRAM and VRAM <-> VRAM through the CUDA runtime (cuda-python), on per-device streams."""

from .backend import CudaBackend, PinnedPool

__all__ = ["CudaBackend", "PinnedPool"]
