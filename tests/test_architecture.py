"""The house's import rules (docs: the README's layout section): policies never reach models or caches."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path, module: str) -> set[str]:
    """Absolute names of every module (and imported name) of ``path``, the module ``module``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = module.split(".")
            if node.level:  # relative: level 1 is the module's own package
                base = parts[: len(parts) - node.level]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def test_policies_never_import_models_or_caches():
    forbidden = ("vlmspec.models", "vlmspec.cache", "vlmspec.probe", "vlmspec.pipeline")
    for path in sorted((ROOT / "vlmspec" / "policies").glob("*.py")):
        bad = {m for m in imported_modules(path, f"vlmspec.policies.{path.stem}") if m.startswith(forbidden)}
        assert not bad, f"{path.name} imports {sorted(bad)}: policies get costs and budgets as plain values"


def test_import_resolution_sees_relative_imports():
    names = imported_modules(ROOT / "vlmspec" / "policies" / "pct.py", "vlmspec.policies.pct")
    assert "vlmspec.costs" in names and "vlmspec.draft.DraftTree" in names
