"""A chat template is code from a model folder or `model.chatTemplate`: bounded before it compiles.

Real templates are a few KB; one over `MAX_TEMPLATE_BYTES` is refused, a file before it is read.
Jinja evaluates constant expressions while it compiles: a template holding `"a" * 3000000000` took
8.5 GiB and 41 s to compile and then failed with a misleading syntax error. So a template is
compiled in transformers' own sandboxed environment with nothing amplified at compile time: no
optimizer pass, every filter taking the context and the operators whose result can outgrow their
operands (`*`, `**`, `%`) intercepted, which Jinja never folds; what it still folds (`+`, `~`,
literals) is no larger than the source. Compiling then costs what the source's size does. While
rendering, those operators refuse to build a string or list over `MAX_TEMPLATE_VALUE` items or an
integer over `MAX_INT_BITS` bits; what `+`, `~`, filters and methods build in a loop is not bounded.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packtrain.core.contract import MAX_RECORD_BYTES
from packtrain.core.errors import ConfigError

__all__ = ["MAX_TEMPLATE_BYTES", "MAX_TEMPLATE_VALUE", "check_size", "compile_template", "read_template"]

MAX_TEMPLATE_BYTES = 1 << 20
"""Largest chat template, in bytes of its source (Qwen3.5's is 7 KB)."""
MAX_TEMPLATE_VALUE = 2 * MAX_RECORD_BYTES
"""Longest string or list a template's operators may build while rendering: twice the largest
record, so rendering any record stays within it."""
MAX_INT_BITS = 1 << 16
"""Largest integer, in bits, a template's operators may build while rendering."""

_SIZED = (str, list, tuple)
# The operators whose result can be far larger than their operands (Jinja folds no intercepted one).
_AMPLIFIERS = frozenset({"*", "**", "%"})
# A printf-style conversion's width and precision (`"%0999999999d" % 1` pads to a billion).
_PERCENT_SIZES = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?")


def check_size(size: int, where: str) -> None:
    """ConfigError naming `where` when a template of `size` bytes is over the cap."""
    if size > MAX_TEMPLATE_BYTES:
        raise ConfigError(
            f"{where}: the chat template is {size} bytes, over the {MAX_TEMPLATE_BYTES}-byte cap for a "
            "template (real ones are a few KB); fix the template, or point model.chatTemplate at a real one"
        )


def read_template(path: Path, key: str) -> str:
    """The template file `path` (`key`: the setting that named it), its size checked before it is
    read and never read past the cap (a file that grows while read included)."""
    try:
        check_size(path.stat().st_size, f"{key}: {path}")
        with path.open("rb") as f:
            data = f.read(MAX_TEMPLATE_BYTES + 1)
        check_size(len(data), f"{key}: {path}")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{key}: {path} is not a readable UTF-8 Jinja chat template ({exc}); point it at one"
        ) from exc


def compile_template(template: str, environment: Any) -> Any:
    """`template` compiled in an overlay of `environment` (transformers' chat-template one) that
    evaluates nothing at compile time and bounds what operators build while rendering."""
    check_size(len(template.encode("utf-8", "surrogatepass")), "chat template")
    env = environment.overlay(optimized=False)
    env.filters = {name: _unfoldable(f) for name, f in environment.filters.items()}
    env.intercepted_binops = _AMPLIFIERS
    env.call_binop = functools.partial(_bounded_binop, environment.binop_table)
    return env.from_string(template)


def _unfoldable(f: Callable[..., Any]) -> Callable[..., Any]:
    """`f` as a filter Jinja never calls while compiling (one that takes the context), handed the
    context, eval context or environment it asks for."""
    import jinja2

    arg = getattr(getattr(f, "jinja_pass_arg", None), "name", None)
    if arg == "context":
        return f
    if arg == "eval_context":
        return jinja2.pass_context(lambda context, *a, **k: f(context.eval_ctx, *a, **k))
    if arg == "environment":
        return jinja2.pass_context(lambda context, *a, **k: f(context.environment, *a, **k))
    return jinja2.pass_context(lambda _context, *a, **k: f(*a, **k))


def _bounded_binop(
    table: dict[str, Callable[[Any, Any], Any]], _context: Any, op: str, a: Any, b: Any
) -> Any:
    """`a op b`, unless the result would be over the caps: a `SecurityError`, which the render
    reports."""
    from jinja2.exceptions import SecurityError

    size = _result_size(op, a, b)
    if size > MAX_TEMPLATE_VALUE:
        raise SecurityError(
            f"the chat template builds a value of {size} characters or items with {op!r}, over the "
            f"{MAX_TEMPLATE_VALUE} a template may build"
        )
    if isinstance(a, int) and isinstance(b, int) and _int_bits(op, a, b) > MAX_INT_BITS:
        raise SecurityError(f"the chat template builds an integer of over {MAX_INT_BITS} bits with {op!r}")
    return table[op](a, b)


def _result_size(op: str, a: Any, b: Any) -> int:
    """How many characters or items `a op b` holds when it repeats or formats strings or lists (an
    upper bound; 0 otherwise)."""
    if op == "*" and isinstance(a, _SIZED) and isinstance(b, int):
        return len(a) * b
    if op == "*" and isinstance(b, _SIZED) and isinstance(a, int):
        return len(b) * a
    if op == "%" and isinstance(a, str):
        widths = [w for m in _PERCENT_SIZES.finditer(a) for w in m.groups() if w]
        if "*" in widths:
            return MAX_TEMPLATE_VALUE + 1  # a width taken from the arguments: refused
        args = b.values() if isinstance(b, dict) else b if isinstance(b, tuple) else (b,)
        return len(a) + sum(int(w) for w in widths) + sum(len(x) for x in args if isinstance(x, _SIZED))
    return 0


def _int_bits(op: str, a: int, b: int) -> float:
    if op == "*":
        return a.bit_length() + b.bit_length()
    if op == "**" and b > 0 and abs(a) > 1:
        return b * math.log2(abs(a))
    return 0
