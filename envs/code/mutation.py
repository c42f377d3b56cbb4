"""Erroneous programs for DeepCoder-MT's error states (PAPER.md §7.2: "a mutation that lowers
the pass count"): a correct program with one small change that makes a unit test fail.

:func:`mutants` lists every one-site mutation of a program (a comparison flipped, ``+`` for
``-`` and back, an integer constant off by one, a boolean negated, a ``return`` of None);
:func:`failing_mutant` tries them in a random order against the task's tests and returns the
first that passes fewer tests than the original, with its pass share.
"""

from __future__ import annotations

import ast
from typing import Callable, Sequence

import numpy as np

_FLIP_COMPARE = {
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_FLIP_BINOP = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Add,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
}


def _sites(tree: ast.AST) -> list[tuple[int, str]]:
    """``(node index in ast.walk order, kind)`` of every place one mutation can change."""
    out = []
    for i, node in enumerate(ast.walk(tree)):
        if isinstance(node, ast.Compare) and type(node.ops[0]) in _FLIP_COMPARE:
            out.append((i, "compare"))
        elif isinstance(node, ast.BinOp) and type(node.op) in _FLIP_BINOP:
            out.append((i, "binop"))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            out.append((i, "int"))
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            out.append((i, "bool"))
        elif isinstance(node, ast.Return) and node.value is not None:
            out.append((i, "return"))
    return out


def _mutate(source: str, index: int, kind: str) -> str:
    tree = ast.parse(source)
    node = list(ast.walk(tree))[index]
    if kind == "compare":
        node.ops[0] = _FLIP_COMPARE[type(node.ops[0])]()
    elif kind == "binop":
        node.op = _FLIP_BINOP[type(node.op)]()
    elif kind == "int":
        node.value = node.value + 1
    elif kind == "bool":
        node.value = not node.value
    else:
        node.value = None
    return ast.unparse(tree)


def mutants(program: str) -> list[str]:
    """Every one-site mutation of ``program`` (module docstring), in source-walk order; none
    for a program that does not parse. Each differs from ``program``'s AST."""
    try:
        tree = ast.parse(program)
    except SyntaxError:
        return []
    original = ast.dump(tree)
    out = []
    for index, kind in _sites(tree):
        mutant = _mutate(program, index, kind)
        if ast.dump(ast.parse(mutant)) != original and mutant not in out:
            out.append(mutant)
    return out


def failing_mutant(
    program: str, pass_share: Callable[[str], float], rng: np.random.Generator, *, tries: int = 8
) -> tuple[str, float] | None:
    """A mutant of ``program`` that passes a smaller share of the tests than ``program``
    (``pass_share(program)``, e.g. by running the task's tests), and that share; up to
    ``tries`` mutants are tried in a random order. None when none of them fails more."""
    if tries < 1:
        raise ValueError(f"failing_mutant: `tries` must be >= 1, got {tries}")
    candidates: Sequence[str] = mutants(program)
    if not candidates:
        return None
    original = pass_share(program)
    for i in rng.permutation(len(candidates))[:tries]:
        share = pass_share(candidates[i])
        if share < original:
            return candidates[i], share
    return None
