"""The probe's copy of a model, called as the model is called: a deep copy sharing the model's
Parameter objects, whose forwards and hooks set on an instance reach the copy's modules, not the
model's.

``copy.deepcopy`` copies a function as itself, so a forward patched as a closure over the model's
own bound forward (TRL's fused LM head, a wrapper made with ``functools.wraps``) still calls the
model's modules from the copy: a probe step would then mark none of the copy's units. Every
function, bound method and ``functools.partial`` set on a copied module's instance or held in its
forward and backward hooks is rebuilt where it reaches an object of the model (through its
closure, defaults, ``__dict__``, bound instance, or a tuple, list or dict in those): that object
becomes its copy. What it reaches otherwise (a trainer, a global) is left alone; the probe then
finds the model's own units running in its step and says so (probe.py). A caller's step closure
(``plan(model, step=...)``) is rebuilt the same way, so a step that closes over the model calls the
copy."""
from __future__ import annotations

import copy
import functools
import types
from typing import Any, Callable, Dict, Tuple

from torch import nn

#: The hook tables of a module whose entries run in its call.
HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")

_EMPTY = object()  # the contents of an empty closure cell


def probe_copy(model: nn.Module) -> Tuple[nn.Module, Callable[[Any], Any]]:
    """A deep copy of ``model`` sharing its Parameters, its instance callables and hooks rebound
    to the copy; and ``rebind(obj)``, which rebuilds another callable the same way."""
    memo: Dict[int, Any] = {id(p): p for p in model.parameters()}
    out = copy.deepcopy(model, memo)
    done: Dict[int, Any] = {}
    for m in out.modules():
        state = vars(m)
        for name, value in list(state.items()):
            if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
                state[name] = _rebound(value, memo, done)
        for table in HOOK_TABLES:
            hooks = state.get(table)
            for key, hook in list(hooks.items()) if hooks else ():
                hooks[key] = _rebound(hook, memo, done)
    return out, lambda obj: _rebound(obj, memo, done)


def _rebound(obj: Any, memo: Dict[int, Any], done: Dict[int, Any]) -> Any:
    """``obj`` with every object of the model it reaches replaced by its copy (``memo``: id in the
    model -> copy); ``obj`` itself where it reaches none."""
    key = id(obj)
    if key in done:
        return done[key]
    if key in memo and key != id(memo):  # the memo keeps its own keep-alive list under id(memo)
        return memo[key]
    done[key] = obj  # a cycle back to obj sees obj
    if isinstance(obj, types.MethodType):
        func, owner = _rebound(obj.__func__, memo, done), _rebound(obj.__self__, memo, done)
        new = obj if func is obj.__func__ and owner is obj.__self__ else \
            types.MethodType(func, owner)
    elif isinstance(obj, types.FunctionType):
        new = _rebound_function(obj, memo, done)
    elif isinstance(obj, functools.partial):
        func = _rebound(obj.func, memo, done)
        args = _rebound(obj.args, memo, done)
        keywords = _rebound(obj.keywords, memo, done)
        state = _rebound(vars(obj), memo, done)
        if func is obj.func and args is obj.args and keywords is obj.keywords and \
                state is vars(obj):
            new = obj
        else:
            new = type(obj)(func, *args, **keywords)
            vars(new).update(state)
    elif type(obj) in (tuple, list):
        got = [_rebound(v, memo, done) for v in obj]
        new = obj if all(a is b for a, b in zip(got, obj)) else type(obj)(got)
    elif type(obj) is dict:
        got = {k: _rebound(v, memo, done) for k, v in obj.items()}
        new = obj if all(got[k] is v for k, v in obj.items()) else got
    else:
        new = obj
    done[key] = new
    return new


def _rebound_function(fn: types.FunctionType, memo: Dict[int, Any], done: Dict[int, Any]):
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:
            cells.append(_EMPTY)
    new_cells = [c if c is _EMPTY else _rebound(c, memo, done) for c in cells]
    defaults = _rebound(fn.__defaults__, memo, done)
    kwdefaults = _rebound(fn.__kwdefaults__, memo, done)
    state = _rebound(vars(fn), memo, done)
    if all(a is b for a, b in zip(new_cells, cells)) and defaults is fn.__defaults__ and \
            kwdefaults is fn.__kwdefaults__ and state is vars(fn):
        return fn
    closure = tuple(types.CellType() if c is _EMPTY else types.CellType(c) for c in new_cells)
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults, closure or None)
    new.__kwdefaults__ = kwdefaults
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    vars(new).update(state)
    return new


def describe_forward(module: nn.Module) -> str:
    """What a forward set on ``module``'s instance is, for a message: its name, the object it is
    bound to and the names its closure holds; "" where the class's forward runs."""
    fn = vars(module).get("forward")
    if fn is None:
        return ""
    inner = getattr(fn, "__func__", getattr(fn, "func", fn))
    code = getattr(inner, "__code__", None)
    parts = [f"{code.co_qualname} at {code.co_filename}:{code.co_firstlineno}" if code else
             getattr(fn, "__qualname__", type(fn).__name__)]
    owner = getattr(fn, "__self__", None)
    if owner is not None and owner is not module:
        parts.append(f"bound to another {type(owner).__name__}")
    if code and code.co_freevars:
        parts.append(f"a closure over {', '.join(code.co_freevars)}")
    return ", ".join(parts)
