"""The mixture-of-experts kind: an experts module of transformers' ``use_experts_implementation``
(every expert's weights in two 3-D tensors) computed by ``moe_experts`` in its own forward, applied
as ``_ExpertsRun`` on its member class. Design: docs/converter.md, "Mixture of experts"."""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torch.nn.utils import parametrize

from .. import ops
from .facts import (DISPLAY, GLOBAL, Condition, Slot, base_type, computes, experts_class, failing,
                    join_path, module_activation, no_hooks, own_forward, unsupported_reason)
from .fallback import count_fused, count_unfused
from .graph import ModelGraph
from .report import Action, Decision, How, Named
from .runtime import MEMBER_MIXINS, Checked, RunMember
from .units import MemberPlan, Options, Placement, UnitKind
from .engines import real_shape

#: the probe's widths (hidden, intermediate): four to fit what the module keeps, one to check it;
#: multiples of 8 elements, the 16-byte strides torch's grouped_mm takes in every dtype it takes
_FIT, _CHECK = ((8, 8), (16, 8), (8, 16), (16, 16)), (24, 40)
_ROUTING_ITEMSIZE = 4  # transformers' routers give float32 routing weights


# -- How moe_experts computes a module, and what must hold at each call ---------------------------

#: transformers' experts implementations whose arithmetic is moe_experts': the class's own loop
#: ("eager", or None), batched_mm and grouped_mm (transformers checks that they agree)
_SAME_ARITHMETIC = ("batched_mm_experts_forward", "grouped_mm_experts_forward")
GPT_OSS_GATE = ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts._apply_gate")
QUICK_GELU_ALPHA = 1.702


class Gate(Named):
    """The gated product an experts module computes."""
    DEFAULT = "default"  # transformers' _default_apply_gate: act(gate) · up
    #: gpt-oss's, (clamp(u, -L, L) + 1) · min(g, L)·σ(α·min(g, L)): quick_gelu's when α is
    #: QuickGELU's 1.702
    GPT_OSS = "gpt_oss"
    UNGATED = ""


class ExpertsForm(NamedTuple):
    """How ``moe_experts`` computes one experts module, read by fuse from its flags and modules."""
    params: Tuple[str, str, Optional[str], Optional[str]]  # gate_up, down and their biases
    layout: str                     # ops.MOE_LAYOUTS
    activation: str                 # the registry's name
    gate: Gate
    flags: Tuple[bool, bool, bool, bool]  # has_gate, has_bias, is_transposed, is_concatenated
    arguments: Tuple[str, str, str]  # the names of its forward's x, top_k_index, top_k_weights

    def sizes(self, m: nn.Module) -> Tuple[int, int, int, int, int]:
        """(experts, hidden, gate_up's width, intermediate, out) at the weights' real shapes."""
        (experts, *up), (_, *down) = (real_shape(m._parameters[n]) for n in self.params[:2])
        i, o = (0, 1) if self.flags[2] else (1, 0)  # is_transposed: stored (in, out)
        return experts, up[i], up[o], down[i], down[o]


FLAG_NAMES = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def experts_dispatch(cls: type) -> Tuple[Any, Any]:
    """(the ExpertsInterface, the class's own forward) that the decorator's forward closes over."""
    fn = cls.forward
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    return cells["experts_interface"].cell_contents, cells["original_forward"].cell_contents


def experts_gate(m: nn.Module) -> Optional[Gate]:
    """The gated product the module's ``_apply_gate`` computes, None for any other (one set on the
    instance included)."""
    moe = sys.modules["transformers.integrations.moe"]
    fn = getattr(type(m), "_apply_gate", None)
    if "_apply_gate" in vars(m) or fn is None:
        return None
    if fn is moe._default_apply_gate:
        return Gate.DEFAULT
    return Gate.GPT_OSS if (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) == \
        GPT_OSS_GATE else None


def _dispatched(m: nn.Module) -> Tuple[Any, Optional[Any]]:
    """(config._experts_implementation, the function the module's forward runs for it: None
    where the forward raises for an unknown name)."""
    impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
    interface, original = experts_dispatch(base_type(m))
    if impl is not None and impl != "eager" and impl not in interface:
        return impl, None
    return impl, interface.get(impl, original)


def _same_arithmetic(m: nn.Module) -> bool:
    fn = _dispatched(m)[1]
    moe = sys.modules["transformers.integrations.moe"]
    return fn is not None and (fn is experts_dispatch(base_type(m))[1] or
                               any(fn is getattr(moe, name, None) for name in _SAME_ARITHMETIC))


def _weights_problem(m: nn.Module, label: str, form: ExpertsForm) -> Optional[str]:
    """None while the module's parameters are 3-D expert weights (2-D biases) moe_experts takes,
    read at their real shapes (ZeRO-3 holds a shape-[0] partition of each between calls)."""
    ps, shapes = [], []
    for name, dim in zip(form.params, (3, 3, 2, 2)):
        if name is None:
            continue
        p = m._parameters.get(name)
        if p is None:
            return (f"{join_path(label, name)} is no longer a parameter of it (computed by a "
                    f"parametrization, as peft's ParamWrapper does for LoRA on expert weights)")
        shape = real_shape(p)
        if type(p) not in (nn.Parameter, torch.Tensor) or len(shape) != dim:
            return (f"{join_path(label, name)} is a {type(p).__name__} of {len(shape)} "
                    f"dimensions, not the {dim}-D tensor moe_experts takes")
        ps.append(p)
        shapes.append(shape)
    experts = {s[0] for s in shapes} | {getattr(m, "num_experts", shapes[0][0])}
    if len(experts) != 1:
        return f"{label}: its parameters hold different numbers of experts ({sorted(experts)})"
    if (reason := unsupported_reason(ps[0])) is not None:
        return f"{label}: {reason}"
    if len({(p.dtype, p.device) for p in ps}) != 1:
        return (f"{label}: its parameters are of different dtypes or devices (" + ", ".join(
            f"{n}: {p.dtype} on {p.device}" for n, p in zip(form.params, ps)) + ")")
    return None


def experts_conditions(m: nn.Module, label: str, form: ExpertsForm,
                       act: Optional[nn.Module]) -> list:
    """What must hold at a call for ``moe_experts`` to compute module ``m`` as ``form`` says
    (without ``GLOBAL``, which only a call checks)."""
    flags = tuple(getattr(m, name, None) for name in FLAG_NAMES)
    out = [own_forward(m, label),
           Condition(lambda: getattr(m, "_is_expert_parallel", None) is False,
                     lambda: f"{label} computes expert parallel (_is_expert_parallel="
                             f"{getattr(m, '_is_expert_parallel', None)}): its experts are one "
                             f"rank's share, which fuse leaves to its forward"),
           Condition(lambda: getattr(m, "has_post_expert_norm", None) is False,
                     lambda: f"{label} normalises each expert's output (has_post_expert_norm="
                             f"{getattr(m, 'has_post_expert_norm', None)}), which moe_experts "
                             f"does not compute"),
           Condition(lambda: tuple(getattr(m, name, None) for name in FLAG_NAMES) == flags ==
                     form.flags,
                     lambda: f"{label}: its use_experts_implementation flags changed (" + ", ".join(
                         f"{name}={getattr(m, name, None)}" for name in FLAG_NAMES) + ")"),
           Condition(lambda: _same_arithmetic(m),
                     lambda: f"{label}: config._experts_implementation={_dispatched(m)[0]!r} "
                             f"runs {getattr(_dispatched(m)[1], '__name__', 'no function')}, "
                             f"not the class's loop, batched_mm or grouped_mm, whose arithmetic "
                             f"moe_experts computes")]
    if form.gate:
        out.append(Condition(lambda: experts_gate(m) == form.gate,
                             lambda: f"{label}: its _apply_gate is not the gated product it "
                                     f"computed when fused ({form.gate})"))
    if form.gate == Gate.GPT_OSS:
        out.append(Condition(
            lambda: getattr(m, "alpha", None) == QUICK_GELU_ALPHA and
            type(getattr(m, "limit", None)) in (int, float),
            lambda: f"{label}: gpt-oss's gated product with alpha={getattr(m, 'alpha', None)} "
                    f"and limit={getattr(m, 'limit', None)!r} is not quick_gelu's (alpha "
                    f"{QUICK_GELU_ALPHA}) clamped at a number"))
    else:
        who = join_path(label, "act_fn")
        out += [Slot(m, "act_fn", act, who), computes(act, who, form.activation),
                own_forward(act, who), no_hooks(act, who)]
    out.append(Condition(lambda: _weights_problem(m, label, form) is None,
                         lambda: _weights_problem(m, label, form) or ""))
    return out


# -- Finding the experts modules -------------------------------------------------------------------

@dataclass(eq=False)
class Experts:
    """One experts module: how ``moe_experts`` computes it, or why it cannot."""
    module: nn.Module
    path: str
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


def _form(e: Experts) -> Optional[str]:
    """Why moe_experts cannot compute the module, else None, ``e.form`` and ``e.act`` set."""
    m = e.module
    missing = [n for n in FLAG_NAMES + ("has_post_expert_norm", "_is_expert_parallel", "config")
               if not hasattr(m, n)]
    if missing:
        return (f"it lacks {', '.join(missing)}, which use_experts_implementation sets in its "
                f"__init__")
    gated, bias, transposed, concatenated = (bool(getattr(m, n)) for n in FLAG_NAMES)
    gate, activation = experts_gate(m) if gated else Gate.UNGATED, None
    if gated and gate is None:
        fn = getattr(type(m), "_apply_gate", None)
        where = "set on the instance" if "_apply_gate" in vars(m) else \
            getattr(fn, "__qualname__", repr(fn))
        return (f"its _apply_gate ({where}) is a gated product of its own, which moe_experts "
                f"does not compute")
    if gate and (gate == Gate.GPT_OSS) == concatenated:
        return (f"its _apply_gate ({gate}) splits gate and up "
                f"{'by chunk' if gate == Gate.DEFAULT else 'alternately'}, but its weights are "
                f"stored is_concatenated={concatenated}")
    if gate == Gate.GPT_OSS:
        if getattr(m, "alpha", None) != QUICK_GELU_ALPHA:
            return (f"gpt-oss's gated product with alpha={getattr(m, 'alpha', None)} is not "
                    f"quick_gelu's (alpha {QUICK_GELU_ALPHA}), the one moe_experts computes")
        activation = "quick_gelu"
    else:
        e.act = m._modules.get("act_fn")
        found = module_activation(e.act) if e.act is not None else None
        if found is None:
            return (f"its act_fn ({type(getattr(m, 'act_fn', None)).__name__}) is no activation "
                    f"module of ckpt_ext.ACTIVATIONS")
        if found.name is None:
            return f"its act_fn: {found.problem}"
        activation = found.name
    try:
        names = list(inspect.signature(experts_dispatch(base_type(m))[1]).parameters)[1:4]
    except (KeyError, TypeError, ValueError, AttributeError):
        return ("its forward is use_experts_implementation's, but not one that closes over "
                "experts_interface and original_forward, which fuse reads to know what each "
                "implementation runs")
    if len(names) < 3:
        return f"its forward takes {len(names)} arguments, not x and the routing"
    up = "gate_up_proj" if gated else "up_proj"
    params = (up, "down_proj", f"{up}_bias" if bias else None, "down_proj_bias" if bias else None)
    layout = ops.moe_layout(gated=gated, interleaved=gated and not concatenated,
                            transposed=transposed)
    e.form = ExpertsForm(params, layout, activation, gate, (gated, bias, transposed, concatenated),
                         tuple(names))
    return None


def _read(graph: ModelGraph, path: str, m: nn.Module) -> Experts:
    cls, e = base_type(m), Experts(m, path)
    if type(m) is not cls and vars(type(m)).get("_ckpt_ext_base") is not cls:
        e.problem = (f"its class is {type(m).__name__}, a subclass of {cls.__name__}" +
                     (" that torch's parametrize made (a parameter of it is computed)"
                      if parametrize.is_parametrized(m) else ""))
        return e
    e.problem = _lora_wrapper(graph, path) or _form(e) or \
        failing(experts_conditions(m, path, e.form, e.act))
    return e


# -- What the module keeps for backward, measured on a probe ---------------------------------------

_PROBED: Dict[tuple, Tuple[Optional[int], int, bool, str]] = {}


def _probe_kept(m: nn.Module, form: ExpertsForm, top_k: int, h: int, i: int, tokens: int):
    """(bytes of the distinct storages autograd keeps while the class's forward runs on ``tokens``
    probe tokens at hidden ``h`` and intermediate ``i``, beyond x and top_k_index; whether it
    keeps top_k_weights): a copy of the module holding probe parameters, not the user's."""
    gate_up = m._parameters[form.params[0]]
    experts, dtype = real_shape(gate_up)[0], gate_up.dtype
    width, transposed = 2 * i if form.flags[0] else i, form.flags[2]
    shapes = [(experts, h, width) if transposed else (experts, width, h),
              (experts, i, h) if transposed else (experts, h, i), (experts, width), (experts, h)]
    probe = base_type(m).__new__(base_type(m))
    probe.__dict__.update(vars(m))
    params = {name: nn.Parameter(torch.linspace(-1, 1, torch.Size(shape).numel(), dtype=dtype)
                                 .reshape(shape), requires_grad=m._parameters[name].requires_grad)
              for name, shape in zip(form.params, shapes) if name is not None}
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
    impl = getattr(m.config, "_experts_implementation", None) or "eager"
    key = (base_type(m), form, form.sizes(m), m._parameters[form.params[0]].dtype, top_k, impl,
           tuple(m._parameters[n].requires_grad for n in form.params if n))
    if key not in _PROBED:
        experts, hidden, _, inter, out = form.sizes(m)
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
            return [], [Decision(where=e.path, layers=(e.path,), action=Action.LEFT_ALONE,
                                 why=f"{what}: {e.problem}",
                                 activation=form.activation if form else "")]
        gate_up, down = (m._parameters[n] for n in form.params[:2])
        experts, hidden, width, inter, out = form.sizes(m)  # whole under zero.Init
        top_k = getattr(m.config, "num_experts_per_tok", None)
        pairs = top_k or 1
        first, second = 2 * hidden * width, 2 * inter * out  # FLOPs per pair of each GEMM
        extra = pairs * first
        plain = pairs * (2 * (first + second) + first * gate_up.requires_grad +
                         second * down.requires_grad)
        per_token, per_call, w_kept, impl = _kept(m, form, pairs)
        freed = 0 if per_token is None else per_token - (0 if w_kept else
                                                          pairs * _ROUTING_ITEMSIZE)
        act = "quick_gelu, clamped at its limit, up + 1" if form.gate == Gate.GPT_OSS else \
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
        return [Decision(where=e.path, layers=(e.path,), action=Action.FUSED, unit=unit,
                         how=How.MODULE, bytes_per_row=freed, flops_per_row=extra,
                         plain_flops_per_row=plain, why=why, activation=form.activation,
                         bytes_per_call=per_call)], []

    def place(self, graph: ModelGraph, e: Experts, units, misses):
        return [(d, None) for d in misses] + [
            (d, Placement(How.MODULE, e.path, [], e.form.activation, False, self, e,
                          members=[MemberPlan(e.module, 0)], calls=[e.path])) for d in units]

    def runtime(self, graph: ModelGraph, p: Placement, decision: Decision) -> _ExpertsRun:
        e = p.found
        return _ExpertsRun(e.module, e.path, e.form, e.act, decision)


MOE = Moe()


# -- In the user's model ---------------------------------------------------------------------------

class _ExpertsRun(Checked):
    """An experts module of transformers' ``use_experts_implementation``, computed by
    ``moe_experts`` in its own forward while every condition holds, else by the class's."""

    def __init__(self, module: nn.Module, label: str, form: ExpertsForm,
                 act: Optional[nn.Module], decision: Optional[Decision] = None) -> None:
        self.module, self.label, self.form, self.act = module, label, form, act
        self.key = ("moe", module)
        self.decision = decision

    def _conditions(self):
        yield from GLOBAL
        yield from experts_conditions(self.module, self.label, self.form, self.act)

    def compute(self, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
        """The module's output by ``moe_experts``, or None where its class's forward computes it
        (a condition fails, or input the op would refuse: the class's forward raises its own)."""
        names = self.form.arguments
        if len(args) > 3 or set(kwargs) - set(names[len(args):]):
            count_unfused(self, f"{self.label} was called with arguments beyond "
                                f"{', '.join(names)}, which moe_experts does not take")
            return None
        x, idx, w = args + tuple(kwargs.get(name) for name in names[len(args):])
        if self.refused():
            return None
        m, form = self.module, self.form
        gate_up, down, gate_up_bias, down_bias = (
            m._parameters[n] if n is not None else None for n in form.params)
        if any(p is not None and p.shape != real_shape(p)
               for p in (gate_up, down, gate_up_bias, down_bias)):
            count_unfused(self, f"{self.label}: its weights are ZeRO-3 partitions at this call "
                                f"(shape [0]): ZeRO-3 gathers them only where "
                                f"deepspeed.initialize's hooks are on it")
            return None
        if not (isinstance(x, torch.Tensor) and isinstance(idx, torch.Tensor) and
                isinstance(w, torch.Tensor) and x.dim() == 2 and idx.dim() == 2 and
                idx.shape == w.shape and idx.shape[0] == x.shape[0] and
                x.shape[1] == gate_up.shape[1 if form.flags[2] else 2] and
                idx.dtype in (torch.int64, torch.int32) and w.is_floating_point() and
                x.device == idx.device == w.device == gate_up.device and
                (x.dtype == gate_up.dtype or torch.is_autocast_enabled(x.device.type))):
            count_unfused(self, f"{self.label} was called with input moe_experts does not "
                                f"take (its class's forward computes it)")
            return None
        count_fused(self)
        return ops.moe_experts(
            x, idx, w, gate_up, down, activation=form.activation, gate_up_bias=gate_up_bias,
            down_bias=down_bias, layout=form.layout,
            limit=float(m.limit) if form.gate == Gate.GPT_OSS else None,
            up_offset=1.0 if form.gate == Gate.GPT_OSS else 0.0)

    def describe(self, index: int = 0) -> str:
        return f"computes moe_experts ({self.form.activation}, {self.form.layout}) in its forward"


class RunExperts(RunMember):
    """Mixed into an experts class: its forward computes the module by ``moe_experts`` while its
    run's conditions hold, else runs the class's forward."""

    def forward(self, *args, **kwargs):
        run = self._ckpt_ext_run
        out = run.compute(args, kwargs) if run is not None else None
        return self._ckpt_ext_base.forward(self, *args, **kwargs) if out is None else out


MEMBER_MIXINS.append((experts_class, RunExperts))
