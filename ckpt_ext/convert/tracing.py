"""Tracing each user forward with ``torch.fx`` on a meta-device copy, every child opaque: one
:class:`Trace` per module, with a guard per attribute it reads. Design: docs/converter.md."""
from __future__ import annotations

import ast
import contextlib
import copy
import enum
import inspect
import operator
import os
import re
import sys
import textwrap
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx, nn

from .._activation_arithmetic import rng_kept
from .arguments import STAND_IN, _ArgGuard, plan_arguments
from .facts import Fact, join_path
from .runtime import MISSING, _Guard, _OwnerForward
from .engines import meta_memo


_FX_DIR = os.path.dirname(fx.__file__)
_MODULE_FILE = inspect.getsourcefile(nn.Module)


class _LocalTracer(fx.Tracer):
    """Every child opaque; notes each child call the traced method's own code did not make."""

    def __init__(self, forward_code: Any, method: str) -> None:
        super().__init__()
        self.forward_code, self.traced_func_name = forward_code, method
        self.indirect: Dict[str, str] = {}  # node name -> the function the call came from
        self.cut: Optional[Tuple[int, int, Tuple[fx.Node, ...]]] = None  # see to_bool

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True

    def call_module(self, m, forward, args, kwargs):
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith(_FX_DIR)
                                     or frame.f_code.co_filename == _MODULE_FILE):
            frame = frame.f_back
        out = super().call_module(m, forward, args, kwargs)
        if frame is not None and frame.f_code is not self.forward_code and \
                isinstance(out, fx.Proxy):
            code = frame.f_code
            self.indirect[out.node.name] = (f"{frame.f_globals.get('__name__', '?')}."
                                            f"{getattr(code, 'co_qualname', code.co_name)}")
        return out

    def to_bool(self, obj: fx.Proxy) -> bool:
        """A branch of the method's own loopless code on a traced value: go on (then cut there)."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not self.forward_code:
            frame = frame.f_back
        parsed = _parsed(self.forward_code) if frame is not None else None
        if parsed is None or any(isinstance(n, (ast.For, ast.AsyncFor, ast.While))
                                 for n in ast.walk(parsed[0])):  # a loop: lines run out of order
            return super().to_bool(obj)
        if self.cut is None:  # what the code from the branch on can read: the local variables
            live: Dict[fx.Node, None] = {}
            _proxies_in(list(frame.f_locals.values()), live, 0)
            self.cut = (len(self.graph.nodes), frame.f_lineno, tuple(live))
        return False


@dataclass
class Trace:
    ok: bool
    reason: str = ""
    graph: Optional[fx.Graph] = None  # in train(); ``eval_graph`` in eval(), node for node
    eval_graph: Optional[fx.Graph] = None
    method: str = "forward"  # or the method forward names that was analysed in its place
    already_rewritten: bool = False
    indirect: Dict[str, str] = field(default_factory=dict)  # see _LocalTracer
    guards: Tuple[_Guard, ...] = ()
    region_problem: Optional[str] = None   # why it may not mark a region; None if it may
    rewrite_problem: Optional[str] = None  # why it may not be rewritten; None if it may
    # first lines of its simple statements that may not have run whole (see _unrun); None: no source
    unrun: Optional[Tuple[int, ...]] = ()
    calls_out: Tuple[str, ...] = ()  # Python functions not torch's or the stdlib's it called
    counts: Tuple[Tuple[str, str, int], ...] = ()  # (path, name, what one call adds): replayed
    arg_guard: Optional[_ArgGuard] = None  # what it assumed of its optional arguments
    cut_line: Optional[int] = None  # a branch on a traced value: the graph ends in after_branch


def _fingerprint(v: Any, depth: int = 0) -> Any:
    """A comparable summary of an attribute value: contents of containers, identity of objects."""
    if v is None or isinstance(v, (bool, int, str, bytes)):
        return int.__int__(v) if type(v) is _Counted else v
    if isinstance(v, float):
        return ("float", repr(v))
    if isinstance(v, fx.Proxy):
        return ("proxy", id(v))
    if isinstance(v, (torch.Tensor, nn.Module)) or depth > 4:
        return ("obj", id(v))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_fingerprint(x, depth + 1) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((repr(k), _fingerprint(x, depth + 1)) for k, x in v.items()))
    if isinstance(v, (set, frozenset)):
        return ("set", tuple(sorted(repr(_fingerprint(x, depth + 1)) for x in v)))
    state = getattr(v, "__dict__", None)
    if isinstance(state, dict) and not inspect.isroutine(v) and not inspect.ismodule(v):
        return ("obj", id(v), _fingerprint(dict(state), depth + 1))
    return ("obj", id(v))


def _snapshot(m: nn.Module) -> Dict[Tuple[str, str], Any]:
    return {(path, k): _fingerprint(v) for path, sub in m.named_modules(remove_duplicate=False)
            for k, v in vars(sub).items() if not k.startswith("_tensor_constant")}  # fx's own


# -- what a forward reads: attributes of the traced copy, recorded while fx runs the forward ------

# nn.Module's own bookkeeping (``training`` is checked by tracing in both modes) and fuse's
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {
    "forward", "_ckpt_ext_runs", "_ckpt_ext_run", "_ckpt_ext_index"}


class _Reads:
    """The attribute reads of one trace: {(id(module), name): value}; None outside."""
    log: Optional[Dict[Tuple[int, str], Any]] = None
    observed: set = set()   # (id(module), name) of counters whose value the forward looked at


class _Counted(int):
    """An int attribute: adding a number gives another (a count); any other use is a look."""

    def __new__(cls, value: int, key: Tuple[int, str]):
        obj = super().__new__(cls, value)
        obj.key = key
        return obj

    def _count(self, other, op):
        if _Reads.log is None or isinstance(other, bool) or not isinstance(other, int):
            self._look()
            return op(int.__int__(self), other)
        return _Counted(op(int.__int__(self), int.__int__(other)), self.key)

    def _look(self):
        if _Reads.log is not None:
            _Reads.observed.add(self.key)

    __add__ = __radd__ = lambda self, other: self._count(other, operator.add)
    __sub__ = lambda self, other: self._count(other, operator.sub)
    __rsub__ = lambda self, other: self._count(other, lambda a, b: b - a)
    __deepcopy__ = lambda self, memo: self
    __reduce__ = lambda self: (int, (int.__int__(self),))


def _looking(name: str):
    def method(self, *args):
        self._look()
        return getattr(int, name)(int.__int__(self), *(int.__int__(a) if type(a) is _Counted
                                                        else a for a in args))
    return method


for _name in ([f"__{op}__" for op in "bool eq ne lt le gt ge hash index int float complex str repr "
                                     "format neg pos abs invert round trunc floor ceil".split()]
              + [f"__{r}{op}__" for op in "mul truediv floordiv mod divmod pow and or xor lshift "
                                          "rshift".split() for r in ("", "r")]
              + "bit_length bit_count to_bytes conjugate as_integer_ratio is_integer".split()):
    if hasattr(int, _name):
        setattr(_Counted, _name, _looking(_name))


_RECORDING: Dict[type, type] = {}


def _recording_class(cls: type) -> type:
    """A subclass of ``cls`` logging the first value of each attribute a traced forward reads."""
    sub = _RECORDING.get(cls)
    if sub is not None:
        return sub

    def __getattribute__(self, name):
        value = super(sub, self).__getattribute__(name)
        log = _Reads.log
        if log is None or name in _MODULE_INTERNALS or name.startswith("__") or \
                isinstance(value, _OwnerForward):  # a method fuse set: the class's runs
            return value
        if name not in object.__getattribute__(self, "__dict__") and \
                not _class_value(cls, name):
            return value  # a method, a child, a parameter or a buffer, torch's own attributes
        key = (id(self), name)
        if type(value) is int:
            value = _Counted(value, key)
        log.setdefault(key, value)
        return value

    sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__":
                                      cls.__module__, "__qualname__": cls.__qualname__})
    _RECORDING[cls] = sub
    return sub


def _class_value(cls: type, name: str) -> bool:
    """Whether ``name`` is a plain value a class of the user's (not torch's) defines."""
    for klass in cls.__mro__:
        if name in vars(klass):
            if klass.__module__.startswith("torch.") or klass is object:
                return False
            raw = vars(klass)[name]
            return not (inspect.isroutine(raw) or isinstance(raw, (staticmethod, classmethod))
                        or hasattr(type(raw), "__get__"))
    return False


def _guard_value(v: Any, depth: int = 0) -> Optional[bool]:
    """How a guard compares a value: False by value, True by identity, None: it cannot."""
    if v is None or type(v) in (bool, int, float, complex, str, bytes, torch.dtype,
                                torch.device, _Counted):
        return False
    if isinstance(v, enum.Enum):
        return True
    # a container compares by value (a copy): == on functions, classes, enums is identity
    if type(v) in (tuple, list, frozenset, set, dict) and depth < 3:
        items = [*v, *v.values()] if type(v) is dict else v
        return False if all(_guard_value(x, depth + 1) is not None for x in items) else None
    if inspect.isfunction(v) or inspect.isbuiltin(v) or isinstance(v, type):
        return True
    return None


def _plain(v: Any) -> Any:
    if type(v) is _Counted:
        return int.__int__(v)
    if type(v) in (tuple, list, set, frozenset):
        return type(v)(_plain(x) for x in v)
    if type(v) is dict:
        return {_plain(k): _plain(x) for k, x in v.items()}
    return v


_TRAINING_ARG = re.compile(r"training = (True|False)")


def _fixed_arity(m: nn.Module, method: str) -> bool:
    """Whether ``method`` takes no optional arguments, ``*args`` or ``**kwargs`` (fx sees one)."""
    try:
        params = list(inspect.signature(getattr(type(m), method)).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return all(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is p.empty
               for p in params)


def trace_module(clone: nn.Module, orig: nn.Module, method: str = "forward") -> Trace:
    fwd = vars(orig).get(method)  # one fuse set: its class's method is what fx traces
    already = isinstance(fwd, _OwnerForward) and fwd.source is not None
    if fwd is not None and not isinstance(fwd, _OwnerForward):
        return Trace(False, f"its {method} is set on the instance (fx would trace its class's "
                            f"{method}, not what runs)")
    arguments = None if _fixed_arity(orig, method) else \
        plan_arguments(orig) if method == "forward" else f"its {method} has optional arguments"
    if isinstance(arguments, str):
        return Trace(False, arguments)
    code = getattr(inspect.unwrap(getattr(type(orig), method)), "__code__", None)
    graphs, cut_line, ran = [], None, set()
    calls_out: Dict[str, None] = {}
    reads: Dict[Tuple[int, str], Any] = {}
    deltas: Dict[Tuple[str, str], set] = {}  # each attribute tracing changed: by how much
    _Reads.observed = set()
    for mode in (True, False):
        clone.train(mode)
        before = _snapshot(clone)
        tracer = _LocalTracer(code, method if arguments is None else STAND_IN)
        _Reads.log = reads
        if arguments is not None:
            setattr(type(clone), STAND_IN, arguments.stand_in)
        try:  # warnings of the run on placeholders are not the model's
            with warnings.catch_warnings(), _lines_run(code, ran, calls_out):
                warnings.simplefilter("ignore")
                g = tracer.trace(clone)
        except Exception as e:  # fx raises many types (TraceError, TypeError, ...)
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return Trace(False, f"torch.fx cannot trace it ({type(e).__name__}: {msg[:160]})")
        finally:
            _Reads.log = None
            if arguments is not None:
                delattr(type(clone), STAND_IN)
        if tracer.cut is not None:  # nodes before the branch, then after_branch(what is live)
            at, cut_line, live_at = tracer.cut
            nodes = list(g.nodes)
            kept = set(nodes[:at])
            live = dict.fromkeys(n for n in live_at if n in kept)  # the locals at the branch
            live.update((a, None) for n in nodes[at:] for a in n.all_input_nodes if a in kept)
            for n in reversed(nodes[at:]):
                g.erase_node(n)
            g.output(g.call_function(after_branch, tuple(live)))
        after = _snapshot(clone)
        for key in set(before) | set(after):
            a, b = before.get(key), after.get(key)
            if a != b:
                deltas.setdefault(key, set()).add(b - a if type(a) is type(b) is int else None)
        graphs.append((g, tracer.indirect))
    (graph, indirect), (eval_graph, _) = graphs
    codes = [g.python_code(root_module="self").src for g, _ in graphs]
    # F.dropout(h, p, training=self.training): the same code in both modes but for that value
    hands_training = codes[0] != codes[1]
    if hands_training and _TRAINING_ARG.sub("", codes[0]) != _TRAINING_ARG.sub("", codes[1]):
        return Trace(False, f"its {method} runs different code in train() and eval() (it reads "
                            f"self.training)")
    t = Trace(True, "", graph, eval_graph, method=method, already_rewritten=already,
              indirect=indirect, unrun=_unrun(code, ran), calls_out=tuple(calls_out),
              arg_guard=arguments.guard if arguments is not None else None, cut_line=cut_line)
    # every attribute that could steer the forward is a guard; one it changes must be a count
    paths = {id(m): p for p, m in clone.named_modules()}
    changed_names = {join_path(p, k) for p, k in deltas}
    guards, unchecked, steering = [], [], []
    for (mid, name), value in reads.items():
        path = paths.get(mid)
        if path is None:
            continue
        label, same = f"{path}.{name}" if path else name, _guard_value(value)  # join_path
        if label in changed_names:
            if type(value) is not _Counted or (mid, name) in _Reads.observed:
                steering.append(label)
        elif same is None:
            unchecked.append(f"{label} ({type(value).__name__})")
        else:
            want = getattr(orig.get_submodule(path), name, MISSING) if same else _plain(value)
            guards.append(_Guard(path, name, want, same))
    _Reads.observed = set()
    checkpointing = getattr(orig, "gradient_checkpointing", None) if arguments else None
    if isinstance(checkpointing, bool) and not checkpointing:  # transformers' layers
        guards.append(_Guard("", "gradient_checkpointing", False, False))
    t.guards = tuple(guards)
    odd = sorted(join_path(p, k) for (p, k), d in deltas.items() if len(d) != 1 or None in d)
    t.region_problem = _first([
        (checkpointing is True,
         "gradient checkpointing is on for it (gradient_checkpointing=True)"),
        (steering, f"tracing its {method} changed {', '.join(sorted(steering))}, which it also "
                   f"reads other than to count: fuse cannot tell that its path does not depend "
                   f"on them"),
        (unchecked, f"its {method} reads {', '.join(unchecked)}, a value fuse cannot check at "
                    f"each call")])
    t.rewrite_problem = t.region_problem or _first([
        (hands_training, f"its {method} hands self.training to a call (F.dropout(..., "
                         f"training=self.training)), whose value a rewritten forward would fix"),
        (arguments, "its forward has optional arguments or **kwargs: fuse marks regions in it, "
                    "but rewrites only forwards without them"),
        (cut_line is not None,
         f"its {method} branches on a traced value at line {cut_line}, which fx cannot follow"),
        (method != "forward", f"fuse rewrites forward code only, and {method} is another method"),
        (odd, f"tracing its forward changed {', '.join(odd)} by different amounts in train() and "
              f"eval(): a rewritten forward would not know what to replay")])
    if deltas and not t.rewrite_problem:  # a rewrite replays what each count adds
        t.counts = tuple(sorted((p, k, next(iter(d))) for (p, k), d in deltas.items()))
    return t


def _first(whys: List[Tuple[Any, str]]) -> Optional[str]:
    return next((why for cond, why in whys if cond), None)


def after_branch(*values: Any) -> Any:
    """Stands, in a graph cut at a branch, for all the method does from there on."""
    return None


def _proxies_in(v: Any, out: Dict[fx.Node, None], depth: int) -> None:
    if isinstance(v, fx.Proxy):
        out[v.node] = None
    elif depth < 4 and isinstance(v, (list, tuple, set, frozenset, dict)):
        for x in v.values() if isinstance(v, dict) else v:
            _proxies_in(x, out, depth + 1)


def _parsed(code: Any) -> Optional[Tuple[ast.AST, int]]:
    """(the parsed source of ``code``'s function, its first line); None without source."""
    try:
        lines, start = inspect.getsourcelines(code)
        return ast.parse(textwrap.dedent("".join(lines))), start
    except (OSError, TypeError, SyntaxError):
        return None


# -- Every user forward of one model, traced -------------------------------------------------------

def trace_model(model: nn.Module, facts: Dict[int, Fact]):
    """The :class:`Trace` of each module by id, and (path, why) for those not fully analysed."""
    wanted = [(p, m) for p, m in model.named_modules() if facts[id(m)].traced]
    traces, not_analysed = {}, []
    if not wanted:
        return traces, not_analysed
    with rng_kept():
        try:  # a deep copy, its parameters and buffers on the meta device (never a full copy)
            clone = copy.deepcopy(model, meta_memo(model))
        except Exception as e:  # each module failed, with why: the reason its Linears give
            why = f"the model could not be copied for analysis ({type(e).__name__}: {e})"
            return {id(m): Trace(False, why) for _, m in wanted}, \
                [("", f"{why}; only nn.Sequential contents were considered")]
        clones, unrecorded = dict(clone.named_modules()), None
        try:  # every module of the copy gets its recording class
            for m in clone.modules():
                m.__class__ = _recording_class(type(m))
        except TypeError as e:
            unrecorded = f"fuse cannot record what its forward reads ({type(e).__name__}: {e})"
        for path, m in wanted:
            t = trace_module(clones[path], m)
            calls = [n for n in t.graph.nodes if n.op == "call_module"] if t.ok else []
            if not t.ok or calls and all(n.name in t.indirect for n in calls):
                t = _method_trace(clones[path], m, t)
            if t.ok and unrecorded:
                t.region_problem = t.rewrite_problem = unrecorded
            traces[id(m)] = t
            if not t.ok:
                not_analysed.append((path, t.reason))
            elif t.cut_line is not None:
                not_analysed.append((path, f"fuse analysed its {t.method} up to line {t.cut_line}, "
                                           f"where it branches on a traced value (fx cannot "
                                           f"follow that)"))
            elif t.method != "forward":
                not_analysed.append((path, f"{t.reason}; fuse analysed the method its forward "
                                           f"names, {t.method}, in its place"))
    return traces, not_analysed


def _method_trace(clone: nn.Module, m: nn.Module, t: Trace) -> Trace:
    """The trace of the one method the forward names that calls children, else ``t``."""
    code = getattr(inspect.unwrap(type(m).forward), "__code__", None)
    found = []
    for name in dict.fromkeys(code.co_names if code is not None else ()):
        if name == "forward" or name in vars(nn.Module) or name.startswith("__") or \
                not inspect.isfunction(inspect.getattr_static(type(m), name, None)):
            continue
        mt = trace_module(clone, m, name)
        if mt.ok and any(n.op == "call_module" for n in mt.graph.nodes):
            found.append(mt)
    if len(found) != 1:
        return t
    found[0].reason = t.reason if not t.ok else \
        f"its forward calls its children only through {found[0].method}"
    return found[0]


@contextlib.contextmanager
def _lines_run(code: Any, ran: set, calls_out: Dict[str, None]):
    """Adds to ``ran`` each line of ``code`` that runs, to ``calls_out`` each function of the
    user's it calls; a tracer already installed (coverage, a debugger) gets every event."""
    prev = sys.gettrace()

    def scope(frame, event, arg):
        chained = prev(frame, event, arg) if prev is not None else None
        caller = frame.f_back
        if caller is not None and caller.f_code is code and \
                not os.path.realpath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
            calls_out[f"{frame.f_code.co_name} ({frame.f_code.co_filename})"] = None
        if frame.f_code is not code:
            return chained

        def step(frame, event, arg):
            nonlocal chained
            if event == "line":
                ran.add(frame.f_lineno)
            if chained is not None:
                chained = chained(frame, event, arg)
            return step
        return step

    sys.settrace(scope)
    try:
        yield
    finally:
        sys.settrace(prev)


#: torch's, the standard library's and ckpt_ext's code: it reads no state of the user's
_LIBRARY_DIRS = tuple(os.path.join(os.path.realpath(d), "") for d in
                      (os.path.dirname(torch.__file__), os.path.dirname(os.__file__),
                       os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# expressions that run in part: a statement holding one may run a part tracing did not see
_PARTIAL = (ast.IfExp, ast.BoolOp, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
            ast.Lambda)


def _unrun(code: Any, ran: set) -> Optional[Tuple[int, ...]]:
    """First lines of the simple statements that did not run, or run in part; None: no source."""
    parsed = _parsed(code)
    fn = parsed[0].body[0] if parsed is not None and parsed[0].body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    shift, out = parsed[1] - 1, []
    compound = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.AsyncWith)
    silent = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Global, ast.Nonlocal,
              ast.Pass)

    def walk(stmts):
        for st in stmts:
            if isinstance(st, compound) or type(st).__name__ in ("Match", "TryStar"):
                for field_name in ("body", "orelse", "finalbody", "handlers", "cases"):
                    for child in getattr(st, field_name, ()):
                        walk(child.body if isinstance(child, ast.ExceptHandler) or
                             type(child).__name__ == "match_case" else [child])
            elif not isinstance(st, silent):
                first, last = st.lineno + shift, (st.end_lineno or st.lineno) + shift
                if not ran & set(range(first, last + 1)) or \
                        any(isinstance(n, _PARTIAL) for n in ast.walk(st)):
                    out.append(first)
    walk(fn.body[1:] if ast.get_docstring(fn) is not None else fn.body)
    return tuple(out)


def statement_source(code: Any, line: int) -> Optional[ast.stmt]:
    """The statement of ``code``'s function that starts at ``line``, parsed; None if not found."""
    parsed = _parsed(code)
    return next((n for n in ast.walk(parsed[0]) if isinstance(n, ast.stmt) and
                 n.lineno + parsed[1] - 1 == line), None) if parsed is not None else None
