"""What a forward does with its optional arguments and ``**kwargs``, read from its source, and the
stand-in it is traced through. Design: docs/converter.md, "Optional arguments"."""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Callable, NamedTuple, Optional, Set, Tuple, Union

from torch import nn

STAND_IN = "_ckpt_ext_traced"  # the name the stand-in has on the analysis copy's class


class _ArgGuard(NamedTuple):
    """What the analysed forward assumed of its arguments: each of ``given`` is not None."""
    names: frozenset
    positional: int
    given: Tuple[str, ...] = ()
    order: Tuple[str, ...] = ()

    def holds(self, args: tuple, kwargs: dict) -> bool:
        return len(args) <= self.positional and all(
            (args[k] if k < len(args) else kwargs.get(name)) is not None
            for name, k in zip(self.given, map(self.order.index, self.given)))

    def describe(self) -> str:
        return ", ".join(f"{name} given (not None)" for name in self.given)


class ArgumentPlan(NamedTuple):
    stand_in: Callable        # (self, required..., passed...) -> the forward's result
    guard: Optional[_ArgGuard]  # None where nothing needs checking at call time


def plan_arguments(m: nn.Module) -> Union[ArgumentPlan, str]:
    """How to trace ``m``'s forward with optional arguments or ``**kwargs``, else why not."""
    fn = inspect.unwrap(type(m).forward)
    params = list(inspect.signature(fn).parameters.values())[1:]
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError):
        node = None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "its forward has optional arguments and its source cannot be read"
    looked_at, tested = _looked_at(node, {p.name for p in params}, set(m._modules))
    required, passed, given = [], [], []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY):
            what = f"*{p.name}" if p.kind == p.VAR_POSITIONAL else f"a positional-only {p.name}"
            return f"its forward takes {what}; fx would see only the traced arity"
        if p.kind == p.VAR_KEYWORD:
            if p.name in looked_at:
                return (f"its forward uses **{p.name} other than to hand it to a child module; "
                        f"fx would see only the traced keys")
        elif p.default is p.empty:
            required.append(p.name)
        elif p.name in looked_at and not (p.name in tested and p.default is None):
            return (f"its forward looks at its optional argument {p.name}={p.default!r} (not "
                    f"only handing it to a child); fx would see only one value of it")
        else:
            passed.append(p.name)
            if p.name in looked_at:  # only tested against None: traced given, guarded so
                given.append(p.name)
    guard = None
    if given:
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        positional = [p.name for p in named if p.kind == p.POSITIONAL_OR_KEYWORD]
        guard = _ArgGuard(frozenset(p.name for p in named), len(positional), tuple(given),
                          tuple(positional))
    # the stand-in: def _ckpt_ext_traced(self, a, b): return fn(self, a=a, b=b), **kwargs empty
    names, scope = required + passed, {"_fn": fn}
    src = (f"def {STAND_IN}(self{''.join(', ' + n for n in names)}):\n"
           f"    return _fn(self{''.join(f', {n}={n}' for n in names)})\n")
    exec(compile(src, "<ckpt_ext.fuse stand-in>", "exec", dont_inherit=True), scope)
    return ArgumentPlan(scope[STAND_IN], guard)


def _looked_at(fn: ast.AST, names: Set[str], children: Set[str]) -> Tuple[Set[str], Set[str]]:
    """The names among ``names`` the body uses other than as an argument of a call of a child
    ``self.<child>(...)`` (assigning counts), and those of them it only tests against None."""
    own = fn.args.args[0].arg if fn.args.args else "self"  # what the method calls itself
    handed: Set[int] = set()  # ids of the Name nodes handed to a child
    none_tests: Set[int] = set()  # ... and of those tested against None
    for c in ast.walk(fn):
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and \
                isinstance(c.func.value, ast.Name) and c.func.value.id == own and \
                c.func.attr in children:
            handed.update(id(a) for a in c.args if isinstance(a, ast.Name))
            handed.update(id(k.value) for k in c.keywords if isinstance(k.value, ast.Name))
        elif isinstance(c, ast.Compare) and len(c.ops) == 1 and \
                isinstance(c.ops[0], (ast.Is, ast.IsNot)) and isinstance(c.left, ast.Name) and \
                isinstance(c.comparators[0], ast.Constant) and c.comparators[0].value is None:
            none_tests.add(id(c.left))
    used, other = set(), set()
    for body in fn.body:
        for n in ast.walk(body):
            if isinstance(n, ast.Name) and n.id in names and id(n) not in handed:
                used.add(n.id)
                if id(n) not in none_tests:
                    other.add(n.id)
    return used, used - other
