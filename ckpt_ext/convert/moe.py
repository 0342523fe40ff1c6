"""The mixture-of-experts kind: an experts module of transformers' ``use_experts_implementation``
(every expert's weights in two 3-D tensors) computed by ``moe_experts`` in its own forward, applied
as ``_ExpertsRun`` on its member class. Design: docs/converter.md, "Mixture of experts"."""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.utils import parametrize

from .. import ops
from .facts import DISPLAY, LayerKind, base_type, failing, module_activation
from .graph import LayerCall, ModelGraph
from .report import Decision
from .runtime import (FLAG_NAMES, QUICK_GELU_ALPHA, ExpertsForm, _ExpertsRun, experts_conditions,
                      experts_dispatch, experts_gate)
from .units import MemberPlan, Options, Placement, UnitKind
from .zero3 import real_shape

#: the probe's widths (hidden, intermediate): four to fit what the module keeps, one to check it;
#: multiples of 8 elements, the 16-byte strides torch's grouped_mm takes in every dtype it takes
_FIT, _CHECK = ((8, 8), (16, 8), (8, 16), (16, 16)), (24, 40)
_ROUTING_ITEMSIZE = 4  # transformers' routers give float32 routing weights


@dataclass(eq=False)
class Experts:
    """One experts module: how ``moe_experts`` computes it, or why it cannot."""
    module: nn.Module
    path: str
    holder: Optional[nn.Module]
    name: str
    form: Optional[ExpertsForm] = None
    act: Optional[nn.Module] = None
    problem: Optional[str] = None
    takes = ()
    not_analysed = ()


def _lora_wrapper(graph: ModelGraph, path: str) -> Optional[str]:
    """Why the module is left alone when a peft layer holds it (LoRA on its expert weights)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None or path not in graph.parent:
        return None
    targeted, at, wrapper = [], path, None
    while at in graph.parent and isinstance(graph.parent[at][0], tuners.BaseTunerLayer):
        wrapper, at, _ = graph.parent[at]
        targeted.append(getattr(wrapper, "parameter_name", "?"))
    if wrapper is None:
        return None
    if type(wrapper).__name__ != "ParamWrapper":
        return (f"it is the base layer of peft's {type(wrapper).__name__} ({at}), whose forward "
                f"moe_experts does not compute")
    return (f"LoRA on its expert weights: peft's ParamWrapper ({at}, made by LoraConfig("
            f"target_parameters=[...]) for {', '.join(targeted)}) adds the low-rank "
            f"update to those parameters through a parametrization at each call, and fuse does "
            f"not compute LoRA on expert weights: the experts compute their own forward")


def _form(m: nn.Module) -> Tuple[Optional[ExpertsForm], Optional[nn.Module], Optional[str]]:
    """(how moe_experts computes the module, its activation module, None), or why it cannot."""
    missing = [n for n in FLAG_NAMES + ("has_post_expert_norm", "_is_expert_parallel", "config")
               if not hasattr(m, n)]
    if missing:
        return None, None, (f"it lacks {', '.join(missing)}, which use_experts_implementation "
                            f"sets in its __init__")
    gated, bias, transposed, concatenated = (bool(getattr(m, n)) for n in FLAG_NAMES)
    gate, act, activation = experts_gate(m) if gated else "", None, None
    if gated and gate is None:
        fn = getattr(type(m), "_apply_gate", None)
        where = "set on the instance" if "_apply_gate" in vars(m) else \
            getattr(fn, "__qualname__", repr(fn))
        return None, None, (f"its _apply_gate ({where}) is a gated product of its own, which "
                            f"moe_experts does not compute")
    if gate and (gate == "gpt_oss") == concatenated:
        return None, None, (f"its _apply_gate ({gate}) splits gate and up "
                            f"{'by chunk' if gate == 'default' else 'alternately'}, but its "
                            f"weights are stored is_concatenated={concatenated}")
    if gate == "gpt_oss":
        if getattr(m, "alpha", None) != QUICK_GELU_ALPHA:
            return None, None, (f"gpt-oss's gated product with alpha={getattr(m, 'alpha', None)}"
                                f" is not quick_gelu's (alpha {QUICK_GELU_ALPHA}), the one "
                                f"moe_experts computes")
        activation = "quick_gelu"
    else:
        act = m._modules.get("act_fn")
        found = module_activation(act) if act is not None else None
        if found is None:
            return None, None, (f"its act_fn ({type(getattr(m, 'act_fn', None)).__name__}) is no "
                                f"activation module of ckpt_ext.ACTIVATIONS")
        if found.name is None:
            return None, None, f"its act_fn: {found.problem}"
        activation = found.name
    try:
        names = list(inspect.signature(experts_dispatch(base_type(m))[1]).parameters)[1:4]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None, None, ("its forward is use_experts_implementation's, but not one that closes "
                            "over experts_interface and original_forward, which fuse reads to "
                            "know what each implementation runs")
    if len(names) < 3:
        return None, None, f"its forward takes {len(names)} arguments, not x and the routing"
    up = "gate_up_proj" if gated else "up_proj"
    params = (up, "down_proj", f"{up}_bias" if bias else None, "down_proj_bias" if bias else None)
    layout = ops.moe_layout(gated=gated, interleaved=gated and not concatenated,
                            transposed=transposed)
    return ExpertsForm(params, layout, activation, gate, (gated, bias, transposed, concatenated),
                       tuple(names)), act, None


def _read(graph: ModelGraph, path: str, m: nn.Module) -> Experts:
    cls = base_type(m)
    holder, _, name = graph.parent.get(path, (None, "", ""))
    e = Experts(m, path, holder, name)
    if type(m) is not cls and vars(type(m)).get("_ckpt_ext_base") is not cls:
        e.problem = (f"its class is {type(m).__name__}, a subclass of {cls.__name__}" +
                     (" that torch's parametrize made (a parameter of it is computed)"
                      if parametrize.is_parametrized(m) else ""))
        return e
    e.problem = _lora_wrapper(graph, path)
    if e.problem is None:
        e.form, e.act, e.problem = _form(m)
    if e.problem is None:
        e.problem = failing(experts_conditions(m, path, e.form, e.act))
    return e


# -- What the module keeps for backward, measured on a probe ---------------------------------------

_PROBED: Dict[tuple, Tuple[Optional[int], int, bool, str]] = {}


def _probe_kept(m: nn.Module, form: ExpertsForm, top_k: int, h: int, i: int, tokens: int):
    """(bytes of the distinct storages autograd keeps while the class's forward runs on ``tokens``
    probe tokens at hidden ``h`` and intermediate ``i``, beyond x and top_k_index; whether it
    keeps top_k_weights): a copy of the module holding probe parameters, not the user's."""
    gate_up = m._parameters[form.params[0]]
    experts, dtype = real_shape(gate_up)[0], gate_up.dtype
    width = 2 * i if form.flags[0] else i
    transposed = form.flags[2]
    shapes = [(experts, h, width) if transposed else (experts, width, h),
              (experts, i, h) if transposed else (experts, h, i), (experts, width), (experts, h)]
    probe = base_type(m).__new__(base_type(m))
    probe.__dict__.update(vars(m))
    params = {}
    for name, shape in zip(form.params, shapes):
        if name is not None:
            n = int(torch.tensor(shape).prod())
            params[name] = nn.Parameter(torch.linspace(-1, 1, n, dtype=dtype).reshape(shape),
                                        requires_grad=m._parameters[name].requires_grad)
    probe.__dict__["_parameters"] = params
    x = torch.linspace(-1, 1, tokens * h, dtype=dtype).reshape(tokens, h).requires_grad_()
    idx = (torch.arange(tokens)[:, None] + torch.arange(top_k)) % experts
    w = torch.full((tokens, top_k), 1 / top_k, requires_grad=True)
    own = {t.untyped_storage().data_ptr() for t in [x, idx, *params.values()]}
    kept, saved = {}, []

    def pack(t):
        saved.append(t)  # alive until counted: no storage is freed and its address reused
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autocast("cpu", enabled=False), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = base_type(m).forward(probe, x, idx, w)
    del out
    ptr = w.untyped_storage().data_ptr()
    return sum(b for p, b in kept.items() if p != ptr), ptr in kept


def _kept(m: nn.Module, form: ExpertsForm, top_k: int):
    """(bytes kept per token beyond x and top_k_index, or None where the probe's measure does not
    extrapolate; bytes kept per call; whether top_k_weights is kept; the implementation's name),
    measured on probes of the module's class at small widths, bilinear in hidden and
    intermediate (gathered rows, gate and up, expert outputs; batched_mm's gathered weights)."""
    gate_up, down = (real_shape(m._parameters[n]) for n in form.params[:2])
    dtype = m._parameters[form.params[0]].dtype
    impl = getattr(m.config, "_experts_implementation", None) or "eager"
    key = (base_type(m), form, tuple(gate_up), tuple(down), dtype, top_k,
           impl, tuple(m._parameters[n].requires_grad for n in form.params if n))
    if key not in _PROBED:
        experts = gate_up[0]
        per_token, per_call, w_kept = {}, set(), set()
        try:
            for h, i in _FIT + (_CHECK,):
                (one, w1), (two, w2) = (_probe_kept(m, form, top_k, h, i, t * experts)
                                        for t in (1, 2))
                per_token[h, i] = (two - one) // experts
                per_call.add(one - experts * per_token[h, i])
                w_kept |= {w1, w2}
        except Exception:  # the class's forward does not run on probe widths here
            _PROBED[key] = None, 0, False, impl
            return _PROBED[key]
        fit = _bilinear(per_token)
        hidden = gate_up[1 if form.flags[2] else 2]
        inter = down[1 if form.flags[2] else 2]
        out = down[2 if form.flags[2] else 1]
        good = fit(*_CHECK) == per_token[_CHECK] and len(per_call) == 1 and len(w_kept) == 1 and \
            out == hidden
        good = good and fit(hidden, inter).denominator == 1
        _PROBED[key] = (int(fit(hidden, inter)) if good else None, per_call.pop() if good else 0,
                        w_kept.pop(), impl)
    return _PROBED[key]


def _bilinear(p: Dict[Tuple[int, int], int]):
    """f(h, i) = a + b·h + c·i + d·h·i through the values ``p`` takes at the widths ``_FIT``."""
    (h0, i0), (h1, _), (_, i1), _ = _FIT
    d = Fraction((p[h1, i1] - p[h0, i1]) - (p[h1, i0] - p[h0, i0]), (h1 - h0) * (i1 - i0))
    b = Fraction(p[h1, i0] - p[h0, i0], h1 - h0) - d * i0
    c = Fraction(p[h0, i1] - p[h0, i0], i1 - i0) - d * h0
    a = p[h0, i0] - b * h0 - c * i0 - d * h0 * i0
    return lambda h, i: a + b * h + c * i + d * h * i


# -- The kind --------------------------------------------------------------------------------------

class Moe(UnitKind):
    def find(self, graph: ModelGraph, taken: set, options: Options) -> List[Experts]:
        return [_read(graph, path, m) for path, m in graph.modules if graph.facts[id(m)].experts]

    def decide(self, graph: ModelGraph, e: Experts, options: Options):
        m, form = e.module, e.form
        what = "an experts module (mixture of experts)"
        if e.problem is not None:
            return [], [Decision(e.path, (e.path,), "left alone", "", "", 0, 0, 0,
                                 f"{what}: {e.problem}",
                                 activation=form.activation if form else "")]
        gate_up, down = (m._parameters[n] for n in form.params[:2])
        up_shape, down_shape = real_shape(gate_up), real_shape(down)  # whole under zero.Init
        transposed = form.flags[2]
        experts, width = up_shape[0], up_shape[2 if transposed else 1]
        hidden = up_shape[1 if transposed else 2]
        inter, out = down_shape[1 if transposed else 2], down_shape[2 if transposed else 1]
        top_k = getattr(m.config, "num_experts_per_tok", None)
        pairs = top_k or 1
        first, second = 2 * hidden * width, 2 * inter * out  # FLOPs per pair of each GEMM
        extra = pairs * first
        plain = pairs * (2 * (first + second) + first * gate_up.requires_grad +
                         second * down.requires_grad)
        per_token, per_call, w_kept, impl = _kept(m, form, pairs)
        freed = 0 if per_token is None else per_token - (0 if w_kept else
                                                          pairs * _ROUTING_ITEMSIZE)
        act = "quick_gelu, clamped at its limit, up + 1" if form.gate == "gpt_oss" else \
            form.activation
        unit = (f"moe_experts {act}, {experts} experts, top-{top_k or '?'}, {hidden}->"
                f"{'2x' if form.flags[0] else ''}{inter}->{out}" +
                (", biases" if form.flags[1] else "") +
                (f", {form.layout}" if form.layout != "concatenated" else ""))
        name = DISPLAY.get(form.activation, form.activation)
        why = (f"{what} computed by moe_experts in its forward: per routed pair, the gathered "
               f"rows, the gate and up projections, {name}(gate), their product and the "
               f"expert's output, as its {impl} implementation keeps them, are no longer kept, "
               f"only x and the routing (top_k_index, top_k_weights)")
        if per_token is None:
            why += ("; what its implementation keeps was not measured (its forward did not run "
                    "on probe widths, or not as rows and widths say): 0 B claimed")
        elif not w_kept:
            why += (f"; top_k_weights, which {impl} does not keep, is kept: "
                    f"{pairs * _ROUTING_ITEMSIZE} B per token counted against the figure")
        if per_call:
            why += f"; {per_call:,} B per call ({impl}'s tensors per call, such as its offsets)"
        if top_k is None:
            why += "; its config names no num_experts_per_tok: the figures are per routed pair"
        return [Decision(e.path, (e.path,), "fused", unit, "module", freed, extra, plain, why,
                         activation=form.activation, bytes_per_call=per_call)], []

    def place(self, graph: ModelGraph, e: Experts, units, misses):
        out: List[Tuple[Decision, Optional[Placement]]] = [(d, None) for d in misses]
        for d in units:
            call = LayerCall(e.holder, e.name, e.module, LayerKind.EXPERTS, e.path)
            out.append((d, Placement("module", e.path, [], e.form.activation, False, self, e,
                                     members=[MemberPlan(call, 0)], calls=[e.path])))
        return out

    def runtime(self, graph: ModelGraph, p: Placement, decision: Decision) -> _ExpertsRun:
        e = p.found
        return _ExpertsRun(e.module, e.path, e.form, e.act, decision)

    def key(self, p: Placement):
        return ("moe", p.found.module)


MOE = Moe()
