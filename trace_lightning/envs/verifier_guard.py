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
- Wrappers are seen through: `composite` scores each entry with the part its metadata names (`source_dataset`),
  ReseedingDataset with the dataset it wraps, so `admits` screens the answer for the verifier that actually reads it
  (WRAPPERS). A verifier the guard does not know (neither registered nor a known wrapper) is refused.
- `admits` never raises: an answer whose screening fails in any way (3**1e999, ten thousand unary minuses) is refused.

Screening keeps code from running; it does not bound a verifier's time (sympy simplifies `sin(exp(exp(x)))` for
minutes). envs/scoring.py runs verifiers in worker processes with a time limit for that, except the pure
string-compare scorers pinned in PURE_SCORERS, which score in the trainer's process.

tests/envs/test_verifier_guard.py scans every reasoning-gym dataset's `score_answer` for eval / parse_expr /
sympify, so a reasoning-gym release with a new evaluating verifier fails the suite until it is listed here.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import math
import operator
import sys
from collections.abc import Callable
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
MAX_WRAPPING = 8
"""How deep wrappers may nest (a composite of composites) before an entry is refused."""

WRAPPERS: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    "reasoning_gym.composite.CompositeDataset": lambda ds, entry: ds.datasets[entry["metadata"]["source_dataset"]],
    "reasoning_gym.dataset.ReseedingDataset": lambda ds, entry: ds.dataset,
}
"""reasoning-gym classes whose score_answer hands the entry to another dataset's: the dataset it hands it to.
(coaching's Experiment scores through score_answer_with_id, which the env never calls.)"""

PURE_SCORERS: dict[str, tuple[tuple[str, ...], str]] = {
    "reasoning_gym.dataset.ProceduralDataset.score_answer": ((), "d4c377f0ac8e002f"),
    "reasoning_gym.arithmetic.chain_sum.ChainSumDataset.score_answer": (
        ("reasoning_gym.utils.compute_decimal_reward",), "7a6c6a0a13870d30"),
    "reasoning_gym.composite.CompositeDataset.score_answer": ((), "257fe91c6ba27fcb"),
    "reasoning_gym.dataset.ReseedingDataset.score_answer": ((), "c2924c82f4f1c297"),
}
"""score_answer methods that only compare strings (==, `in`, len, Decimal equality) or hand the entry on: they end
in time linear in the answer, so they score in the trainer's process. Each is pinned by a hash of its source and of
the helpers it calls (source_hash): a reasoning-gym release that changes one scores it in a worker again, and
tests/security/test_hostile_answers.py fails until it is read and pinned anew."""

_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Mod, ast.FloorDiv, ast.UAdd, ast.USub)
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class UnsafeAnswer(ValueError):
    """An answer a verifier would evaluate as code, or whose evaluation would not end in reasonable time."""


def check_expression(answer: str) -> None:
    """UnsafeAnswer unless `answer` is arithmetic over numbers and names (the module docstring's rules)."""
    if not isinstance(answer, str):
        raise UnsafeAnswer(f"answer is a {type(answer).__name__}, not a string")
    if len(answer) > MAX_ANSWER_CHARS:
        raise UnsafeAnswer(f"answer of {len(answer)} characters (at most {MAX_ANSWER_CHARS})")
    try:
        tree = ast.parse(answer.strip(), mode="eval")
        _check_node(tree.body, in_power=False)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        if isinstance(e, UnsafeAnswer):
            raise
        raise UnsafeAnswer(f"not an arithmetic expression: {type(e).__name__}: {e}") from e


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
        if not math.isfinite(node.value):
            raise UnsafeAnswer(f"exponent {node.value} is not finite")
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


def scoring_chain(verifier: Any, entry: dict[str, Any]) -> list[Any]:
    """The datasets `entry` passes through when `verifier` scores it: `verifier`, then what each wrapper hands it to,
    ending with the dataset whose score_answer reads the answer. KeyError / ValueError when a wrapper cannot resolve
    it (an entry of no part of the composite) or wrappers nest deeper than MAX_WRAPPING."""
    chain = [verifier]
    while (unwrap := WRAPPERS.get(_class_name(type(chain[-1])))) is not None:
        if len(chain) > MAX_WRAPPING:
            raise ValueError(f"datasets wrapped more than {MAX_WRAPPING} deep")
        chain.append(unwrap(chain[-1], entry))
    return chain


def dataset_name(dataset: Any) -> str | None:
    """The name reasoning-gym registers `dataset`'s class under, or None for a class it does not register."""
    return _registered_names().get(type(dataset))


def admits(verifier: str | Any, answer: str, entry: dict[str, Any] | None = None) -> bool:
    """Whether `answer` may reach the verifier that scores `entry`: a dataset name (never a wrapper's), or a
    reasoning-gym dataset object seen through its wrappers (scoring_chain). An expression verifier's only when
    check_expression passes it (anything else scores 0 unread); another registered verifier's always (the list
    verifiers are guarded inside); an unknown verifier's never. Never raises: an answer whose screening fails is
    refused."""
    try:
        if isinstance(verifier, str):  # a name says nothing of the part a wrapper hands the entry to: refused
            name: str | None = None if verifier in _wrapper_names() else verifier
        else:
            name = dataset_name(scoring_chain(verifier, entry if entry is not None else {})[-1])
        if name is None:
            return False
        if name in EXPRESSION_VERIFIERS:
            check_expression(answer)
        return isinstance(answer, str)
    except Exception:  # UnsafeAnswer, and whatever else odd input makes of the screening: refused, never raised
        return False


def pure_scorer(verifier: Any, entry: dict[str, Any]) -> bool:
    """Whether every score_answer on `entry`'s way through `verifier` is a pinned PURE_SCORERS one (unchanged since
    it was read), so scoring it cannot stall; False when anything cannot be resolved."""
    try:
        return all(_is_pure(type(dataset)) for dataset in scoring_chain(verifier, entry))
    except Exception:
        return False


def source_hash(method: str, helpers: tuple[str, ...] = ()) -> str:
    """First 16 hex digits of the SHA-256 of the sources of `method` and `helpers` (dotted paths)."""
    digest = hashlib.sha256()
    for path in (method, *helpers):
        digest.update(inspect.getsource(_resolve(path)).encode())
    return digest.hexdigest()[:16]


@functools.cache
def _is_pure(cls: type) -> bool:
    method = getattr(cls, "score_answer", None)
    if method is None:
        return False
    name = f"{method.__module__}.{method.__qualname__}"
    pinned = PURE_SCORERS.get(name)
    if pinned is None:
        return False
    try:
        return source_hash(name, pinned[0]) == pinned[1]
    except (OSError, TypeError, AttributeError, ImportError):  # no source to read: not pinned
        return False


def _resolve(path: str) -> Any:
    """The object a dotted path names, module prefix first (`pkg.mod.Class.method`)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut])) or _import(".".join(parts[:cut]))
        if module is not None:
            obj = module
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            return obj
    raise ImportError(f"cannot resolve {path!r}")


def _import(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.cache
def _registered_names() -> dict[type, str]:
    from reasoning_gym.factory import DATASETS

    return {cls: name for name, (cls, _) in DATASETS.items()}


@functools.cache
def _wrapper_names() -> frozenset[str]:
    return frozenset(name for cls, name in _registered_names().items() if _class_name(cls) in WRAPPERS)


def _literal_eval(source: Any, *args: Any) -> Any:
    """What the list verifiers get for `eval`: literals only (lists, tuples, strings, numbers)."""
    return ast.literal_eval(source)


def guard_list_verifiers() -> None:
    """Make every list verifier safe to hand model answers, wherever its dataset object is (alone, inside a composite,
    in a worker process): its module's eval reads literals only. (Expression answers are screened by `admits`.)"""
    from reasoning_gym.factory import DATASETS

    for name in LIST_EVAL_VERIFIERS:
        vars(sys.modules[DATASETS[name][0].__module__])["eval"] = _literal_eval
