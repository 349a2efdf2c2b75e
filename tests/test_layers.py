"""The package's layering, beyond what import-linter checks (pyproject.toml [tool.importlinter]):
no module imports another module's private (underscore) names, and only the CLI imports gspo
modules inside functions (its commands load what they need; nothing is above it); the tests
mirror the packages."""

from __future__ import annotations

import ast
from pathlib import Path

import gspo

SRC = Path(gspo.__file__).parent


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC), ast.parse(path.read_text())


def test_no_private_name_crosses_a_module_boundary():
    bad = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gspo"):
                bad += [f"{rel}: from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_")]
    assert bad == []


def test_gspo_imports_sit_at_module_top_except_in_the_cli():
    bad = []
    for rel, tree in _modules():
        if str(rel) == "cli.py":
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                bad += [f"{rel}:{node.lineno} {n}" for n in names if n.startswith("gspo")]
    assert bad == []


def test_every_layer_says_what_it_is_and_what_it_never_imports():
    for init in sorted(SRC.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "never imports" in doc, init


def test_the_tests_are_laid_out_like_the_packages():
    """tests/<package>/ holds the tests of gspo.<package>; at the top, only what spans the whole
    package (layers, security, registries, end to end, the docs) and the shared conftest."""
    tests = Path(__file__).parent
    folders = {d.name for d in tests.iterdir() if d.is_dir() and d.name not in ("data", "__pycache__")}
    packages = {d.name for d in SRC.iterdir() if (d / "__init__.py").is_file()}
    assert folders <= packages, folders - packages
    top = {p.name for p in tests.glob("test_*.py")}
    assert top == {"test_layers.py", "test_security.py", "test_registry.py", "test_e2e.py",
                   "test_docs.py"}, top
