"""Model answers never run as code in the trainer: a guard in front of reasoning-gym's verifiers that evaluate them.

Nine of reasoning-gym's verifiers evaluate the answer string. Five parse it with sympy's `parse_expr` (countdown,
puzzle24, polynomial_multiplication, simple_integration, intermediate_integration), which is Python's `eval` after
a token rewrite: `__import__('os').system(...)` runs, and `9**9**9` computes for hours. Four fall back to Python's
`eval` to read a list the model may have written (binary_matrix, n_queens, spiral_matrix, string_insertion). An RL
policy is optimised against its verifier, so its answers are hostile input.

- Expression verifiers get only answers that are arithmetic over numbers and names: + - * / % //, unary signs,
  parentheses, calls of a few elementary functions (sin, exp, log, sqrt, ...), and powers whose exponent is a
  number of at most MAX_EXPONENT in size with no power inside; nothing else (attributes, subscripts, other calls,
  keywords, strings, lambdas, comparisons) and at most MAX_ANSWER_CHARS characters. Any other answer scores 0
  without reaching the verifier, as an answer the verifier could not parse would.
- List verifiers read the model's list with `ast.literal_eval` instead of `eval`: their module's `eval` is
  shadowed (a module global wins over the builtin), which is the only thing those modules use it for.

tests/envs/test_verifier_guard.py scans every reasoning-gym dataset's `score_answer` for eval / parse_expr /
sympify, so a reasoning-gym release with a new evaluating verifier fails the suite until it is listed here.
"""

from __future__ import annotations

import ast
import operator
import sys
from fractions import Fraction
from typing import Any

EXPRESSION_VERIFIERS = frozenset(
    {"countdown", "puzzle24", "polynomial_multiplication", "simple_integration", "intermediate_integration"})
"""reasoning-gym datasets whose score_answer runs sympy's parse_expr on the answer."""

LIST_EVAL_VERIFIERS = frozenset({"binary_matrix", "n_queens", "spiral_matrix", "string_insertion"})
"""reasoning-gym datasets whose score_answer falls back to eval(answer) to read a Python list."""

FUNCTIONS = frozenset({"sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh", "tanh",
                       "exp", "log", "ln", "sqrt", "Abs", "abs", "Integral"})
"""Calls an expression answer may hold (integration answers: -cos(2*x)/2 + C, exp(x**2)/2, log(x); some of
intermediate_integration's own answers keep an unevaluated Integral(x**2*cos(x), x))."""

MAX_EXPONENT = 1000
MAX_ANSWER_CHARS = 1000

_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Mod, ast.FloorDiv, ast.UAdd, ast.USub)
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class UnsafeAnswer(ValueError):
    """An answer a verifier would evaluate as code, or whose evaluation would not end in reasonable time."""


def check_expression(answer: str) -> None:
    """UnsafeAnswer unless `answer` is arithmetic over numbers and names (the module docstring's rules)."""
    if len(answer) > MAX_ANSWER_CHARS:
        raise UnsafeAnswer(f"answer of {len(answer)} characters (at most {MAX_ANSWER_CHARS})")
    try:
        tree = ast.parse(answer.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise UnsafeAnswer(f"not an arithmetic expression: {e}") from e
    _check_node(tree.body, in_power=False)


def _check_node(node: ast.AST, in_power: bool) -> None:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise UnsafeAnswer(f"constant {node.value!r} is not a number")
    elif isinstance(node, ast.Name):
        if node.id.startswith("_"):
            raise UnsafeAnswer(f"name {node.id!r}")
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, _OPERATORS):
        _check_node(node.operand, in_power)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        if in_power:
            raise UnsafeAnswer("a power inside a power")
        _check_node(node.left, in_power=True)
        _check_exponent(node.right)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, _OPERATORS):
        _check_node(node.left, in_power)
        _check_node(node.right, in_power)
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS or node.keywords:
            raise UnsafeAnswer(f"call of {ast.unparse(node.func)!r} (allowed: {sorted(FUNCTIONS)}, no keywords)")
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                raise UnsafeAnswer("starred argument")
            _check_node(arg, in_power)
    else:
        raise UnsafeAnswer(f"{type(node).__name__} is not arithmetic")


def _check_exponent(node: ast.AST) -> None:
    """An exponent is a number (+ - * / of numbers, no power, no name) of magnitude at most MAX_EXPONENT."""
    value = _number(node)
    if abs(value) > MAX_EXPONENT:
        raise UnsafeAnswer(f"exponent {float(value):g} (at most {MAX_EXPONENT} in size)")


def _number(node: ast.AST) -> Fraction:
    """The exact value of + - * / over numeric constants; UnsafeAnswer for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _number(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _number(node.left), _number(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise UnsafeAnswer("exponent divides by zero")
        return _ARITHMETIC[type(node.op)](left, right)
    raise UnsafeAnswer("an exponent must be a number")


def admits(dataset: str, answer: str) -> bool:
    """Whether `answer` may reach `dataset`'s verifier: an expression verifier's only when check_expression passes
    it (anything else scores 0 unread); every other verifier's always (the list verifiers are guarded inside)."""
    if dataset not in EXPRESSION_VERIFIERS:
        return True
    try:
        check_expression(answer)
    except UnsafeAnswer:
        return False
    return True


def _literal_eval(source: Any, *args: Any) -> Any:
    """What the list verifiers get for `eval`: literals only (lists, tuples, strings, numbers)."""
    return ast.literal_eval(source)


def guard_verifier(dataset: str, verifier: Any) -> None:
    """Make `verifier` (a reasoning-gym dataset object) safe to hand model answers: its module's eval reads
    literals only, where it is a list verifier. (Expression answers are screened by `admits` instead.)"""
    if dataset in LIST_EVAL_VERIFIERS:
        vars(sys.modules[type(verifier).__module__])["eval"] = _literal_eval
