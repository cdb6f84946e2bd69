"""How fast: the throughput sweep behind `datamover bench` and examples/throughput.py."""

from .runner import Result, format_table, run_sweep
from .workload import WORKLOADS, Case, Workload

__all__ = ["WORKLOADS", "Case", "Result", "Workload", "format_table", "run_sweep"]
