"""An activation module matched by what it computes. A module of the user's own with no
parameters, buffers or children and a forward of one tensor is traced with torch.fx (on proxies:
no data goes through it); its graph must be pointwise (the torch, F and Tensor functions below,
Python's arithmetic and comparisons, Python scalars: no other tensor). That graph, evaluated in
float64 on a fixed probe, is compared with each registry row: it computes a row when its values
and its first derivative (which a fused unit's backward replaces) are within the row's measured
bound, else it is left alone with its traced form and the nearest row. Read by
:func:`ckpt_ext._activation_modules.module_activation`, and by ``convert.facts.node_facts`` for an
activation written as arithmetic in a forward (:func:`written_after`); design: docs/converter.md,
"Activations" and "Function calls inside a run"."""
from __future__ import annotations

import contextlib
import functools
import math
import operator
import random
import sys
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from ._activations import REGISTRY, stock_tensors

# ------------------------------------------------------------------------------------------------
# what a pointwise graph may call

_TORCH = ("abs", "neg", "add", "sub", "mul", "div", "true_divide", "pow", "square", "sqrt",
          "rsqrt", "exp", "expm1", "log", "log1p", "erf", "erfc", "tanh", "sigmoid", "sin", "cos",
          "relu", "clamp", "clamp_min", "clamp_max", "minimum", "maximum", "where", "sign",
          "reciprocal", "gt", "lt", "ge", "le")
_F = ("gelu", "silu", "relu", "softplus", "sigmoid", "tanh", "elu", "selu", "celu", "leaky_relu",
      "mish", "hardtanh", "relu6", "hardsigmoid", "hardswish", "logsigmoid", "softsign")
#: function -> how a form prints it; operators print infix (with their precedence)
_FUNCTIONS: Dict[Any, str] = {**{getattr(torch, n): f"torch.{n}" for n in _TORCH},
                              **{getattr(F, n): f"F.{n}" for n in _F}}
_INFIX = {operator.add: ("+", 1), operator.sub: ("-", 1), operator.mul: ("*", 2),
          operator.truediv: ("/", 2), operator.pow: ("**", 4), operator.gt: (">", 0),
          operator.lt: ("<", 0), operator.ge: (">=", 0), operator.le: ("<=", 0)}
_UNARY = {operator.neg: "-", operator.pos: "+"}
_METHODS = frozenset(n for n in _TORCH if n not in ("true_divide", "where"))
_SCALARS = (bool, int, float, str, type(None))  # str: F.gelu's approximate

# ------------------------------------------------------------------------------------------------
# the probe and the rows' bounds

# The probe: a dense grid over [-20, 20] (relative to its largest value), |x| from 1e-300 to 1e-3
# and ±0 (point by point: there each row is near-linear), and each tail out to ±1e4 (relative to
# its largest value: where exp overflows, softplus's threshold, sigmoid's saturation lie).
_TAIL = torch.logspace(math.log10(20.0), 4.0, 1000, dtype=torch.float64)
_SMALL = torch.logspace(-300.0, -3.0, 298, dtype=torch.float64)
_PARTS = ((torch.linspace(-20.0, 20.0, 40001, dtype=torch.float64), False),
          (torch.cat([_SMALL, -_SMALL, torch.tensor([0.0, -0.0], dtype=torch.float64)]), True),
          (-_TAIL, False), (_TAIL, False))
_PROBE = torch.cat([p for p, _ in _PARTS])

# Each row's bound on the distances (values, derivative) of a form that computes it. Measured on
# this probe (CPU, float64) against the row's own op: the written tanh GELU
# (0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))) 4.5e-15, x·σ(x) 2.2e-16, x·σ(1.702·x) 2.3e-16,
# x·0.5·(1 + erf(x/√2)) 2.8e-14 (its derivative where x < -20: 1e-88 and less); each bound ~9x
# that. A row no written form was measured for takes 10 ulps: its own call is within 1.
_ULPS10 = 10 * torch.finfo(torch.float64).eps
BOUNDS: Dict[str, float] = {**{name: _ULPS10 for name in REGISTRY},
                            "gelu_tanh": 4e-14, "silu": 2e-15, "quick_gelu": 2e-15,
                            "gelu": 2.5e-13}


def _distance(got: Tensor, want: Tuple[Tensor, Tensor]) -> float:
    """The largest relative difference of ``got`` from a row's values (``want``: them and the
    scale each is measured against); inf where one is not finite and the other is, or differs
    (a NaN never passes)."""
    value, scale = want
    finite = torch.isfinite(value)
    if not torch.equal(finite, torch.isfinite(got)) or \
            not torch.equal(got[~finite], value[~finite]):
        return math.inf
    err = (got - value).abs_().div_(scale).masked_fill_(got == value, 0.0)
    return err.max().item()


def _scale(v: Tensor) -> Tensor:
    """What each value is measured against: itself in the pointwise part, else its part's largest
    finite value (inf where it is not finite)."""
    parts, start = [], 0
    for part, pointwise in _PARTS:
        p = v[start:start + len(part)].abs()
        start += len(part)
        finite = torch.isfinite(p)
        parts.append(p if pointwise else torch.where(
            finite, p[finite].max() if finite.any() else p.new_tensor(math.inf), math.inf))
    return torch.cat(parts)


@functools.lru_cache(maxsize=None)
def _row(name: str) -> Tuple[Tuple[Tensor, Tensor], Tuple[Tensor, Tensor]]:
    """Row ``name``'s f and f' on the probe, each with its scale."""
    row = REGISTRY[name]
    with torch.inference_mode(False), torch.no_grad():
        f, d = row.f(_PROBE), row.derivative(_PROBE)
    return (f, _scale(f)), (d, _scale(d))


# ------------------------------------------------------------------------------------------------
# tracing and evaluating a forward

_MODULE_KEYS = frozenset(vars(nn.Module()))


@contextlib.contextmanager
def rng_kept():
    """Every generator a forward could draw from while it traces (torch's CPU and initialised
    CUDA ones, Python's, numpy's) as it was; read by ``convert`` too."""
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    py_state, np = random.getstate(), sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(py_state)
        if np_state is not None:
            np.random.set_state(np_state)


def _pointwise_node(n: fx.Node) -> bool:
    """A call of the lists above on nodes and Python scalars."""
    if n.op == "call_function":
        known = n.target in _FUNCTIONS or n.target in _INFIX or n.target in _UNARY
    else:
        known = n.op == "call_method" and n.target in _METHODS
    plain: list = []
    fx.node.map_aggregate((n.args, n.kwargs), plain.append)
    return known and all(isinstance(a, fx.Node) or type(a) in _SCALARS for a in plain)


def _pointwise(graph: fx.Graph) -> bool:
    """One input, one tensor out, and every node in between pointwise of that input's values."""
    places = [n for n in graph.nodes if n.op == "placeholder"]
    out = next(n for n in graph.nodes if n.op == "output")
    return len(places) == 1 and isinstance(out.args[0], fx.Node) and \
        all(_pointwise_node(n) for n in graph.nodes if n.op not in ("placeholder", "output"))


def _run(graph: fx.Graph, x: Tensor) -> Any:
    """The graph's output for input ``x`` (torch's own functions only: the lists above)."""
    env: Dict[fx.Node, Any] = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            env[n] = x
        elif n.op == "output":
            return env[n.args[0]]
        else:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            env[n] = n.target(*args, **kwargs) if n.op == "call_function" else \
                getattr(args[0], n.target)(*args[1:], **kwargs)


def _evaluate(graph: fx.Graph) -> Optional[Tuple[Tensor, Tensor]]:
    """The graph's values on the probe and their derivative, float64."""
    with torch.inference_mode(False), torch.enable_grad():
        z = _PROBE.clone().requires_grad_(True)
        y = _run(graph, z * 1.0)  # not a leaf: F.relu(x, inplace=True) works on it
        if not isinstance(y, Tensor) or y.shape != z.shape or y.dtype != torch.float64:
            return None
        (d,) = torch.autograd.grad(y.sum(), z, allow_unused=True) if y.requires_grad else (None,)
        return y.detach(), d if d is not None else torch.zeros_like(z)


def _expression(graph: fx.Graph) -> str:
    """The graph as a Python expression of its input ``x``."""
    text: Dict[fx.Node, Tuple[str, int]] = {}

    def arg(a: Any, prec: int) -> str:
        s, p = text[a] if isinstance(a, fx.Node) else \
            (repr(a), 3 if isinstance(a, (int, float)) and a < 0 else 9)
        return f"({s})" if p < prec else s

    def call(n: fx.Node, args) -> str:
        return ", ".join([arg(a, 0) for a in args] + [f"{k}={arg(v, 0)}"
                                                      for k, v in n.kwargs.items()])

    for n in graph.nodes:
        if n.op == "placeholder":
            text[n] = ("x", 9)
        elif n.op == "output":
            return text[n.args[0]][0]
        elif n.target in _INFIX:
            sym, p = _INFIX[n.target]
            text[n] = (f"{arg(n.args[0], p)} {sym} {arg(n.args[1], p + 1)}", p)
        elif n.target in _UNARY:
            text[n] = (f"{_UNARY[n.target]}{arg(n.args[0], 3)}", 3)
        elif n.op == "call_method":
            text[n] = (f"{arg(n.args[0], 9)}.{n.target}({call(n, n.args[1:])})", 9)
        else:
            text[n] = (f"{_FUNCTIONS[n.target]}({call(n, n.args)})", 9)
    return ""


# ------------------------------------------------------------------------------------------------
# the match

class Arithmetic(NamedTuple):
    """A pointwise forward: its traced form, the row it computes (None: none within its bound),
    and its nearest row with the distances of its values and derivative from that row's."""
    form: str
    name: Optional[str]
    nearest: str
    distances: Tuple[float, float]

    def describe(self) -> str:
        v, d = self.distances
        return (f"its forward computes {self.form}, no activation of the fused ops to float64 "
                f"rounding: nearest {self.nearest}, its values {v:.1e} and derivative {d:.1e} "
                f"from that row's (relative; a match is within {BOUNDS[self.nearest]:.0e})")


def arithmetic(m: nn.Module) -> Optional[Arithmetic]:
    """What module ``m``'s class forward computes, when ``m`` holds no parameters, buffers or
    children, nothing but Python scalars besides nn.Module's own attributes, no forward of its
    own, and its forward is pointwise of one tensor; else None. Made once per class, forward,
    mode and those scalars (a fused run asks at each call)."""
    cls = type(m)
    cls = getattr(cls, "_ckpt_ext_base", cls)  # a run member: the class fuse gave it stands for
    fwd = vars(cls).get("forward")
    if fwd is None or m._parameters or m._buffers or m._modules:
        return None
    own = vars(m)
    extra = tuple((k, type(own[k]), own[k]) for k in sorted(own.keys() - _MODULE_KEYS)
                  if not k.startswith("_ckpt_ext_"))
    if "forward" in vars(m) or any(t not in _SCALARS for _, t, _ in extra):
        return None
    return _matched(cls, fwd, m.training, extra)


@functools.lru_cache(maxsize=256)
def _matched(cls: type, fwd: Any, training: bool, extra: tuple) -> Optional[Arithmetic]:
    shell = object.__new__(cls)  # the class's __new__ and __init__ are the user's: not run
    nn.Module.__init__(shell)
    shell.training = training
    vars(shell).update({k: v for k, _, v in extra})
    before = dict(vars(shell))
    try:
        with rng_kept():
            graph = fx.Tracer().trace(shell)
    except Exception:  # noqa: BLE001 - any error of the user's forward: not an activation
        return None
    if vars(shell).keys() != before.keys() or \
            any(vars(shell)[k] is not v for k, v in before.items()):
        return None  # a forward that changes its module is no activation
    return graph_arithmetic(graph)


def graph_arithmetic(graph: fx.Graph) -> Optional[Arithmetic]:
    """What a traced graph of one input computes, when it is pointwise; else None."""
    if not _pointwise(graph):
        return None
    try:
        got = _evaluate(graph)
    except Exception:  # noqa: BLE001 - a call with arguments torch refuses
        return None
    if got is None:
        return None
    distances = {name: (_distance(got[0], _row(name)[0]), _distance(got[1], _row(name)[1]))
                 for name in REGISTRY}
    nearest = min(distances, key=lambda name: (max(distances[name]), distances[name][0]))
    match = max(distances[nearest]) <= BOUNDS[nearest]
    return Arithmetic(_expression(graph), nearest if match else None, nearest, distances[nearest])


def written_after(x: fx.Node, order: Dict[fx.Node, int]):
    """An activation written out as several nodes of a traced forward after ``x`` (a Linear's
    output): the pointwise nodes computed from ``x`` and Python scalars alone, holding every use
    of ``x`` and ending in one node that the rest of the graph uses. (that node, the others in
    graph order, what they compute, the tensors stock autograd keeps for them per layer) when
    they compute a row; else None. ``order``: each node's place in its graph."""
    part: Dict[fx.Node, None] = {}
    reach, todo = set(), list(x.users)
    while todo and len(reach) < 64:
        n = todo.pop()
        if n not in reach and _pointwise_node(n):
            reach.add(n)
            todo += n.users
    for n in sorted(reach, key=order.__getitem__):
        if all(a is x or a in part for a in n.all_input_nodes):
            part[n] = None
    ends = [n for n in part if any(u not in part for u in n.users)]
    if len(part) < 2 or len(ends) != 1 or any(u not in part for u in x.users):
        return None
    graph = fx.Graph()
    env = {x: graph.placeholder("x")}
    for n in part:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[ends[0]])
    found = graph_arithmetic(graph)
    if found is None or found.name is None:
        return None
    kept = stock_tensors(lambda z: _run(graph, z))
    return ends[0], tuple(n for n in part if n is not ends[0]), found, kept
