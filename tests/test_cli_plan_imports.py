"""The thin edges do not reach into the study: ``agentrl_jax/cli/`` (every module but
``cli/reproduce.py``, the study's own command) and ``agentrl_jax/plan/`` import nothing from
``agentrl_jax.reproduce``, neither at import time (a fresh interpreter imports them and its
``sys.modules`` is read) nor when a command runs (every import statement of theirs, those
inside functions too, followed through the modules it names, ``envs`` included)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = "agentrl_jax.reproduce"
ALLOWED = {"agentrl_jax.cli.reproduce"}  # the study's command, and the app that holds it
EDGES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for folder in ("agentrl_jax/cli", "agentrl_jax/plan")
    for path in (ROOT / folder).glob("*.py")
    if path.name not in ("reproduce.py", "__main__.py")  # __main__ runs the whole app
)


def _file(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def _imports(module: str) -> set[str]:
    """The project's modules (``agentrl_jax``, ``envs``) that ``module`` imports anywhere, their
    parent packages included (importing ``a.b.c`` runs ``a`` and ``a.b`` first)."""
    path = _file(module)
    if path is None:
        return set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            names |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    out = set()
    for name in names:
        parts = name.split(".")
        if parts[0] in ("agentrl_jax", "envs"):
            out |= {
                ".".join(parts[:i]) for i in range(1, len(parts) + 1) if _file(".".join(parts[:i]))
            }
    return out


def _reaches(start: str) -> list[str]:
    """The chain of imports from ``start`` to the first module of :data:`FORBIDDEN` it reaches
    (``[]``: none), not following :data:`ALLOWED` nor the ``cli`` package (the app, which
    holds every command)."""
    parent = {start: None}
    todo = [start]
    while todo:
        module = todo.pop(0)
        if module.startswith(FORBIDDEN):
            chain = [module]
            while parent[chain[-1]] is not None:
                chain.append(parent[chain[-1]])
            return chain[::-1]
        for name in sorted(_imports(module) - ALLOWED - {"agentrl_jax.cli"}):
            if name not in parent:
                parent[name] = module
                todo.append(name)
    return []


def test_the_edges_are_found():
    assert {"agentrl_jax.cli.evaluate", "agentrl_jax.cli.plan", "agentrl_jax.plan"} <= set(EDGES)
    assert "agentrl_jax.plan.programs" in EDGES and "agentrl_jax.cli.reproduce" not in EDGES


def test_importing_cli_and_plan_loads_nothing_of_reproduce():
    """Each edge module imported in a fresh interpreter of its own: nothing of
    ``agentrl_jax.reproduce`` in its ``sys.modules``."""
    code = (
        "import importlib, json, sys\n"
        "importlib.import_module(sys.argv[1])\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r}))))\n"
    )
    loaded = {}
    for module in EDGES:
        out = subprocess.run(
            [sys.executable, "-c", code, module],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout
        found = json.loads(out.strip().splitlines()[-1])
        if found:
            loaded[module] = found
    assert loaded == {}


@pytest.mark.parametrize("module", EDGES)
def test_no_command_of_cli_or_plan_imports_reproduce(module):
    """Every import of the module, inside its functions too, followed through the modules it
    names: none reaches ``agentrl_jax.reproduce`` (the chain is the message)."""
    assert _reaches(module) == [], " -> ".join(_reaches(module))
