"""Megatron-LM's per-layer patterns, the value of ``--moe-layer-freq``.

An int N puts an MoE layer at layers 0, N, 2N, ... (counted from 0); a list holds one 0 (dense) or
1 (MoE) per layer, written as Megatron's Python list expression, e.g. ``([0]*3+[1]*58)`` for
DeepSeek-V3's three dense first layers. The expression is read by walking its syntax tree (lists,
integers, ``+``, ``*`` and parentheses only), never by ``eval``.
"""

from __future__ import annotations

import ast
import itertools
from typing import List, Union

LayerPattern = Union[int, List[int]]


def parse_layer_pattern(value) -> LayerPattern:
    """An int >= 1 or a non-empty list of 0/1 from an int, a list, or text ("2", "([0]*3+[1]*5)")."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = _evaluate(ast.parse(text, mode="eval").body)
        except (SyntaxError, ValueError, TypeError, RecursionError):
            raise ValueError(
                f"{text!r} is neither an integer nor a list expression of 0 and 1 such as ([0]*3+[1]*5)"
            ) from None
    if isinstance(value, bool):
        raise ValueError(f"expected an integer >= 1 or a list of 0 and 1, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"an integer frequency must be >= 1, got {value}")
        return value
    if isinstance(value, (list, tuple)) and value and all(v in (0, 1) and not isinstance(v, bool) for v in value):
        return [int(v) for v in value]
    raise ValueError(f"expected an integer >= 1 or a non-empty list of 0 and 1, got {value!r}")


def _evaluate(node: ast.AST):
    """Integers, lists of integers, and + / * between them: what Megatron's pattern allows."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.List):
        items = [_evaluate(item) for item in node.elts]
        if not all(isinstance(item, int) for item in items):
            raise ValueError("nested lists")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add):
            if isinstance(left, list) != isinstance(right, list):
                raise TypeError("a list plus an integer")
            return left + right
        count = left if isinstance(left, int) else right
        if isinstance(left, list) == isinstance(right, list) or count > 1 << 20:
            raise TypeError("a list repeats by one integer")
        return left * right
    raise ValueError(f"{type(node).__name__} is not part of a layer pattern")


def expand_layer_pattern(pattern: LayerPattern, num_layers: int) -> List[int]:
    """One 0/1 per layer: Megatron's ``i % N == 0`` for an int, the list itself otherwise."""
    if isinstance(pattern, int):
        return [int(layer % pattern == 0) for layer in range(num_layers)]
    return list(pattern)


def layer_pattern_text(pattern: List[int]) -> str:
    """The shortest run-length expression of a list, as a Megatron launch script writes it."""
    runs = [f"[{bit}]*{len(list(group))}" for bit, group in itertools.groupby(pattern)]
    return "(" + "+".join(runs) + ")"
