"""What a forward with optional arguments or ``**kwargs`` does with them, read from its source:
an argument only handed to child modules (``self.self_attn(h, attention_mask=attention_mask,
**kwargs)``) cannot change the forward's path, since fx keeps children opaque; one it only tests
against None (``if encoder_hidden_states is not None``) is traced given, and the owner's forward
checks at each call that it is (:class:`ckpt_ext.convert.runtime._ArgGuard`); any other use (an
expression, a comparison with a value) may change the path, and the forward is then not analysed.
It is traced through a stand-in that takes the optional arguments as placeholders and
``**kwargs`` empty. Design: docs/converter.md, "Optional arguments"."""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Callable, List, NamedTuple, Optional, Set, Tuple, Union

from torch import nn

from .runtime import _ArgGuard

STAND_IN = "_ckpt_ext_traced"  # the name the stand-in has on the analysis copy's class


class ArgumentPlan(NamedTuple):
    stand_in: Callable        # (self, required..., passed...) -> the forward's result
    guard: Optional[_ArgGuard]  # None where nothing needs checking at call time


def plan_arguments(m: nn.Module) -> Union[ArgumentPlan, str]:
    """How to trace ``m``'s forward, whose signature has optional arguments or ``**kwargs``; a
    string says why it cannot be."""
    fn = inspect.unwrap(type(m).forward)
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())[1:]
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return "its forward has optional arguments and its source cannot be read"
    node = tree.body[0]
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
    return ArgumentPlan(_stand_in(fn, required + passed), guard)


def _looked_at(fn: ast.AST, names: Set[str], children: Set[str]) -> Tuple[Set[str], Set[str]]:
    """The names among ``names`` that the function's body uses other than as an argument of a
    call of a child module ``self.<child>(...)`` (assigning to one counts as a use), and those
    of them it only tests against None (``x is None``, ``x is not None``)."""
    own = fn.args.args[0].arg if fn.args.args else "self"  # what the method calls itself
    handed: Set[int] = set()
    for call in ast.walk(fn):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and \
                isinstance(call.func.value, ast.Name) and call.func.value.id == own and \
                call.func.attr in children:
            handed.update(id(a) for a in call.args if isinstance(a, ast.Name))
            handed.update(id(k.value) for k in call.keywords if isinstance(k.value, ast.Name))
    none_tests: Set[int] = set()
    for c in ast.walk(fn):
        if isinstance(c, ast.Compare) and len(c.ops) == 1 and \
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


def _stand_in(fn: Callable, names: List[str]) -> Callable:
    """``def _ckpt_ext_traced(self, a, b): return fn(self, a=a, b=b)``: the forward with its
    arguments as placeholders and no keyword in its ``**kwargs``."""
    src = (f"def {STAND_IN}(self{''.join(', ' + n for n in names)}):\n"
           f"    return _fn(self{''.join(f', {n}={n}' for n in names)})\n")
    scope = {"_fn": fn}
    exec(compile(src, "<ckpt_ext.fuse stand-in>", "exec", dont_inherit=True), scope)
    return scope[STAND_IN]
