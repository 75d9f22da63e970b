"""The model zoo: tiny dense, MoE and DSA models shaped like production configurations, each
declaring its units.

- `catalog`: the named models (`ENTRIES`), their declared units and seeded inputs;
- `model`, `decoder`, `moe`, `dsa`, `mla`, `layers`: the modules they are built from;
- `distributed`: the fake process group for export and real gloo ranks for reference data;
- `goldens`: exporting rank 0 of each model as `tests/golden/NAME.pb` + `NAME.safetensors`.
"""

from .catalog import ENTRIES, ZooEntry, declared_units, entry, make_inputs, model_decls
from .config import ZooConfig

__all__ = [
    "ENTRIES",
    "ZooConfig",
    "ZooEntry",
    "declared_units",
    "entry",
    "make_inputs",
    "model_decls",
]
