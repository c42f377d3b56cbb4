"""Who may import the reproduction (docs/architecture.md): of the command line only
``cli/reproduce.py`` (``reproduce``, ``train``, ``compare``); ``plan`` and the evaluation
(one floor below it, ``eval``'s whole front door included) never. Read from the source with
``ast`` (every import statement, at module level or inside a function), directly and then
followed through the modules each names (``envs`` included), as a command would run them.

Left (issue #60's note): ``eval --config`` and ``plan --config`` read the whole study config,
whose defaults are each environment's study's (``reproduce/studies``); ``bench rl-loop`` sets
up the default study. :data:`KNOWN` holds exactly those chains, so any other path fails."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "agentrl_jax"
PROJECT = ROOT.parent
REPRODUCE = "agentrl_jax.reproduce"
# until the environments' config defaults leave reproduce/studies (module docstring): the one
# direct import left, and the only chains from an edge into reproduce
PENDING = {("agentrl_jax.reproduce.config", "load_config")}
KNOWN = {
    "agentrl_jax.cli.evaluate": ["agentrl_jax.cli.evaluate", "agentrl_jax.reproduce"],
    "agentrl_jax.cli.plan": ["agentrl_jax.cli.plan", "agentrl_jax.reproduce"],
    "agentrl_jax.cli.bench": [
        "agentrl_jax.cli.bench",
        "agentrl_jax.bench.rl_loop",
        "agentrl_jax.reproduce",
    ],
    "agentrl_jax.cli": ["agentrl_jax.cli", "agentrl_jax.cli.evaluate", "agentrl_jax.reproduce"],
}


def _imports(path: Path) -> list[tuple[str, str]]:
    """``(module, name)`` of every import in ``path`` (name "" for ``import module``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def _from_reproduce(path: Path) -> list[tuple[str, str]]:
    return [
        (module, name)
        for module, name in _imports(path)
        if (module == REPRODUCE or module.startswith(REPRODUCE + "."))
        and (module, name) not in PENDING
    ]


def test_cli_plan_and_evaluation_import_nothing_from_reproduce():
    files = [p for p in (ROOT / "cli").glob("*.py") if p.name != "reproduce.py"]
    files += list((ROOT / "plan").rglob("*.py")) + list((ROOT / "evaluation").rglob("*.py"))
    assert len(files) > 40
    found = {str(p.relative_to(ROOT)): _from_reproduce(p) for p in files}
    assert {p: i for p, i in found.items() if i} == {}
    # the check sees an import of reproduce where there is one
    assert _from_reproduce(ROOT / "cli" / "reproduce.py")


FORBIDDEN = "agentrl_jax.reproduce"
ALLOWED = {"agentrl_jax.cli.reproduce"}  # the study's command, and the app that holds it
EDGES = sorted(
    ".".join(path.relative_to(PROJECT).with_suffix("").parts).removesuffix(".__init__")
    for folder in ("agentrl_jax/cli", "agentrl_jax/plan")
    for path in (PROJECT / folder).glob("*.py")
    if path.name not in ("reproduce.py", "__main__.py")  # __main__ runs the whole app
)


def _file(module: str) -> Path | None:
    path = PROJECT.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def _imported(module: str) -> set[str]:
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
        for name in sorted(_imported(module) - ALLOWED - {"agentrl_jax.cli"}):
            if name not in parent:
                parent[name] = module
                todo.append(name)
    return []


def test_the_edges_are_found():
    assert {"agentrl_jax.cli.evaluate", "agentrl_jax.cli.plan", "agentrl_jax.plan"} <= set(EDGES)
    assert "agentrl_jax.plan.programs" in EDGES and "agentrl_jax.cli.reproduce" not in EDGES
    assert _reaches("agentrl_jax.cli.reproduce")  # the walk sees a path where there is one


@pytest.mark.parametrize("module", EDGES)
def test_no_command_of_cli_or_plan_reaches_reproduce(module):
    """Every import of the module, inside its functions too, followed through the modules it
    names: none reaches ``agentrl_jax.reproduce`` but the :data:`KNOWN` chains (the chain is
    the message)."""
    assert _reaches(module) == KNOWN.get(module, []), " -> ".join(_reaches(module))
