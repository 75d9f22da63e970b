"""The package's Python surface: each public module lists its names in `__all__`, each name
listed is documented, one name means one object across the package, and every warning the
package issues derives from `PlannerWarning` (one filter silences or raises them all)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import recompute_planner as rp


def _modules(private: bool) -> list[ModuleType]:
    names = [info.name for info in pkgutil.iter_modules(rp.__path__)]
    return [
        importlib.import_module(f"recompute_planner.{name}")
        for name in names
        if private or not name.startswith("_")
    ]


PUBLIC = _modules(private=False)


def test_every_public_module_lists_its_names_in_all():
    assert {module.__name__.rsplit(".", 1)[1] for module in PUBLIC} >= {
        "annotate", "api", "compile", "errors", "markers", "plans", "sac",
    }
    for module in PUBLIC:
        listed = getattr(module, "__all__", None)
        assert listed, f"{module.__name__} has no __all__"
        missing = [name for name in listed if not hasattr(module, name)]
        assert not missing, f"{module.__name__}.__all__ names what it lacks: {missing}"


def _own_docstring(obj: object) -> str | None:
    """A class's or function's own docstring (a class inherits none here)."""
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
        return doc if isinstance(doc, str) else None
    return obj.__doc__


def test_every_class_and_function_a_public_module_lists_is_documented():
    undocumented = [
        f"{module.__name__}.{name}"
        for module in [*PUBLIC, rp]
        for name in module.__all__
        if (inspect.isclass(obj := getattr(module, name)) or inspect.isfunction(obj))
        and not (_own_docstring(obj) or "").strip()
    ]
    assert not undocumented, f"listed in __all__ without a docstring: {undocumented}"


def test_one_name_is_one_object_across_the_public_modules():
    """`from recompute_planner.X import Plan` and `rp.Plan` are the same class, whatever X."""
    seen: dict[str, tuple[str, object]] = {}
    clashes = []
    for module in [rp, *PUBLIC]:
        for name in module.__all__:
            obj = getattr(module, name)
            first = seen.setdefault(name, (module.__name__, obj))
            if first[1] is not obj:
                clashes.append(f"{name}: {first[0]} and {module.__name__}")
    assert not clashes, f"one name, two objects: {clashes}"


def test_every_warning_the_package_defines_derives_from_planner_warning():
    warnings = {
        obj
        for module in _modules(private=True)
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and issubclass(obj, Warning)
        and obj.__module__.startswith("recompute_planner")
    }
    assert len(warnings) >= 5  # PlannerWarning and the four kinds the exporter and SAC issue
    assert all(issubclass(warning, rp.PlannerWarning) for warning in warnings), warnings
    assert {w.__name__ for w in warnings} <= set(rp.__all__)
