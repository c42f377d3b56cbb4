"""Who may import the reproduction (docs/architecture.md): of the command line only
``cli/reproduce.py`` (``reproduce``, ``train``, ``compare``); ``plan`` and the evaluation
(one floor below it, ``eval``'s whole front door included) never. Read from the source with
``ast`` (every import statement, at module level or inside a function)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "agentrl_jax"
REPRODUCE = "agentrl_jax.reproduce"
# until the config's reader leaves reproduce/config.py (issue #60, item 2): the one import left
PENDING = {("agentrl_jax.reproduce.config", "load_config")}


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
