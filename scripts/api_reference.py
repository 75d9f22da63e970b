#!/usr/bin/env python3
"""Writes docs/api.md, the Python API reference, from the package's docstrings.

Every public module (a module of ``recompute_planner`` whose name does not start with ``_``),
and the package itself, lists its names in ``__all__``; each class, function and constant
listed gets one entry, under the module that defines it (the package's section for names
defined in its private modules), with its signature and its docstring as written. A class's
entry also lists its public methods and properties that have docstrings of their own. A name
that several modules list is documented once; the others link to it.

    source scripts/env.sh
    python scripts/api_reference.py            # rewrite docs/api.md
    python scripts/api_reference.py --check    # exit 1 when docs/api.md is not what it writes

``python/tests/test_api_reference.py`` runs the check.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

import recompute_planner as rp

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "api.md"
PACKAGE = rp.__name__

_HEADER = """# Python API reference

Generated from the package's docstrings by `scripts/api_reference.py` (a test fails when this
page no longer matches them): every name each public module lists in `__all__`, under the module
that defines it. How the pieces fit together: [python.md](python.md).
"""


def public_modules() -> list[ModuleType]:
    """The package, then its public modules by name."""
    names = sorted(info.name for info in pkgutil.iter_modules(rp.__path__))
    return [rp] + [
        importlib.import_module(f"{PACKAGE}.{name}") for name in names if not name.startswith("_")
    ]


def anchor(heading: str) -> str:
    """The anchor a Markdown renderer gives ``heading`` (GitHub's rule)."""
    return "".join(
        "-" if c == " " else c.lower() for c in heading if c.isalnum() or c in " -_"
    )


def home(module: ModuleType, name: str, modules: list[ModuleType]) -> ModuleType:
    """The module whose section documents ``module.name``: the public module that defines it,
    else the package."""
    obj = getattr(module, name)
    defined_in = getattr(obj, "__module__", None) if not inspect.ismodule(obj) else None
    for candidate in modules:
        if candidate.__name__ == defined_in and name in candidate.__all__:
            return candidate
    if module is not rp and name in rp.__all__:
        return rp
    return module


def title(module: ModuleType, name: str) -> str:
    return f"`{module.__name__}.{name}`"


class _Written:
    """An annotation as the source writes it (the package's modules postpone annotations, so
    each is a string): shown without the quotes a string's repr adds."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _as_written(annotation: object) -> object:
    return _Written(annotation) if isinstance(annotation, str) else annotation


def _stable_default(value: object) -> object:
    """A default as the same text on every run: a set's elements sorted (its own order
    follows string hashing, which changes per process)."""
    if isinstance(value, (set, frozenset)):
        inner = ", ".join(sorted(map(repr, value)))
        kind = type(value).__name__
        return _Written(f"{kind}({{{inner}}})" if value else f"{kind}()")
    return value


def signature(obj: object) -> str:
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    parameters = [
        p.replace(annotation=_as_written(p.annotation), default=_stable_default(p.default))
        for p in sig.parameters.values()
    ]
    return str(
        sig.replace(
            parameters=parameters, return_annotation=_as_written(sig.return_annotation)
        )
    )


def members(cls: type) -> list[str]:
    """A class's public methods and properties that have docstrings of their own."""
    lines = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            doc, shown = value.__doc__, f"`.{name}`"
        elif isinstance(value, (staticmethod, classmethod)):
            doc, shown = value.__func__.__doc__, f"`.{name}{signature(value.__func__)}`"
        elif inspect.isfunction(value):
            doc, shown = value.__doc__, f"`.{name}{signature(value)}`"
        else:
            continue
        if doc and doc.strip():
            lines.append(f"- {shown}: {_indent(inspect.cleandoc(doc), '  ')}")
    return lines


def entry(module: ModuleType, name: str) -> list[str]:
    obj = getattr(module, name)
    lines = [f"### {title(module, name)}", ""]
    if inspect.isclass(obj):
        kind = "exception" if issubclass(obj, BaseException) else "class"
        bases = [b.__qualname__ for b in obj.__bases__ if b is not object]
        shown = f"{kind} {name}" + (f"({', '.join(bases)})" if bases else "")
        lines += ["```python", shown, "```", ""]
        doc = vars(obj).get("__doc__")
        if isinstance(doc, str):
            lines += [inspect.cleandoc(doc), ""]
        if own := members(obj):
            lines += own + [""]
    elif callable(obj):
        lines += ["```python", f"def {name}{signature(obj)}", "```", ""]
        if obj.__doc__:
            lines += [inspect.cleandoc(obj.__doc__), ""]
    elif inspect.ismodule(obj):
        lines += ["```python", f"module {name}", "```", ""]
        if obj.__doc__:
            lines += [inspect.cleandoc(obj.__doc__).split("\n\n")[0], ""]
    elif _is_plain(obj):
        lines += ["```python", f"{name}: {type(obj).__name__} = {obj!r}", "```", ""]
    else:  # a table: its type (its contents are the source's)
        lines += ["```python", f"{name}: {type(obj).__name__}", "```", ""]
    return lines


def render() -> str:
    modules = public_modules()
    out = [_HEADER]
    for module in modules:
        heading = f"`{module.__name__}`"
        out += [f"## {heading}", ""]
        if module.__doc__:
            out += [inspect.cleandoc(module.__doc__).split("\n\n")[0], ""]
        listed_elsewhere = []
        for name in sorted(module.__all__, key=str.lower):
            obj = getattr(module, name)
            if obj in modules:
                section = f"`{obj.__name__}`"
                listed_elsewhere.append(f"- `{name}`: [{section}](#{anchor(section)})")
                continue
            where = home(module, name, modules)
            if where is module:
                out += entry(module, name)
            else:
                link = anchor(title(where, name))
                listed_elsewhere.append(f"- `{name}`: [{title(where, name)}](#{link})")
        if listed_elsewhere:
            out += ["Also here:", ""] + listed_elsewhere + [""]
    return "\n".join(out).rstrip() + "\n"


def _is_plain(value: object) -> bool:
    """A constant whose repr is short and the same on every run."""
    if isinstance(value, tuple):
        return all(_is_plain(item) for item in value)
    return isinstance(value, (str, int, float, bool, type(None)))


def _indent(text: str, prefix: str) -> str:
    return text.replace("\n", "\n" + prefix)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    text = render()
    if args.check:
        if REFERENCE.read_text() != text:
            print(f"{REFERENCE} is stale: run python scripts/api_reference.py", file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
