"""PyTorch side of the recompute planner (SPEC §7): markers, exporter, model zoo."""

__version__ = "0.1.0"
