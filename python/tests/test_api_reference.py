"""docs/api.md is the package's docstrings: `scripts/api_reference.py` writes it, and this test
fails when the page and the docstrings (or `__all__`) part ways. Re-bless with
`UPDATE_GOLDEN=1` (or run the script)."""

from __future__ import annotations

import importlib.util
import os

from export_support import REPO_ROOT


def _script():
    spec = importlib.util.spec_from_file_location(
        "api_reference", REPO_ROOT / "scripts" / "api_reference.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_is_the_docstrings():
    script = _script()
    written = script.render()
    if os.environ.get("UPDATE_GOLDEN"):
        script.REFERENCE.write_text(written)
    assert script.REFERENCE.read_text() == written, (
        "docs/api.md is stale: run `python scripts/api_reference.py` (or UPDATE_GOLDEN=1)"
    )


def test_the_api_reference_documents_every_listed_name_once():
    """Each class, function and constant any public module lists has exactly one entry, under
    the module that defines it; a listed public module has its section."""
    script = _script()
    text = script.REFERENCE.read_text()
    modules = script.public_modules()
    for module in modules:
        for name in module.__all__:
            obj = getattr(module, name)
            if obj in modules:
                assert f"\n## `{obj.__name__}`\n" in text, obj.__name__
                continue
            where = script.home(module, name, modules)
            assert text.count(f"\n### {script.title(where, name)}\n") == 1, (module, name)
