"""What fuse knows of modules and calls, and the conditions (``holds()``, ``describe()``) it checks
once and a run at every call; nothing here evaluates the user's tensors. See docs/converter.md."""
from __future__ import annotations

import enum
import inspect
import operator
import os
import sys
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from .. import _C, modules as _modules, ops
from .._activation_arithmetic import written_after
from .._activation_modules import Recognised, bind, module_activation, node_activation, sig, \
    unmatched
from .._activations import REGISTRY, stock_tensors
from .._block_checkpoint import CheckpointedForward
from .._observers import foreign_global_hooks
from .._unit_stats import SetByFuse
from ..modules import _has_hooks as has_hooks
from .. import _dropout_autograd as dropout_unit
from . import linears
from .engines import fix_for as hooks_fix
from .linears import (LINEAR_FUNCTIONS, base_type, form_of, linear_args, op_terms,
                      stored_weight)

__all__ = ["Recognised", "bind", "has_hooks", "module_activation", "node_activation", "op_terms"]


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def foreign_forward(m: nn.Module) -> bool:
    fwd = vars(m).get("forward")
    return fwd is not None and not isinstance(fwd, SetByFuse)


def experts_class(cls: type) -> bool:
    """An experts class of transformers' ``use_experts_implementation`` (a mixture of experts): its
    forward is the decorator's, which dispatches on ``config._experts_implementation``."""
    moe = sys.modules.get("transformers.integrations.moe")
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return moe is not None and code is not None and code.co_name == "forward" and \
        os.path.normcase(code.co_filename) == os.path.normcase(moe.__file__)


def layer_forward(lin: nn.Module):
    """The Linear's own class forward, bound (what it computes called without hooks)."""
    return base_type(lin).forward.__get__(lin)


def checkpointing_layer(m: nn.Module) -> bool:
    """A transformers GradientCheckpointingLayer (recomputed whole while checkpointing is on)."""
    return any(c.__name__ == "GradientCheckpointingLayer" and
               c.__module__.startswith("transformers") for c in type(m).__mro__)


def on_path(model: nn.Module, where: str) -> List[Tuple[str, nn.Module]]:
    """(path, module) of the model and of each module on the way down to ``where``, itself too."""
    out, m, path = [("", model)], model, ""
    for name in where.split(".") if where else ():
        m = m._modules.get(name)
        if m is None:
            break
        path = join_path(path, name)
        out.append((path, m))
    return out


def checkpointing_layers(model: nn.Module, where: str) -> List[Tuple[str, nn.Module]]:
    """(path, module) of the checkpointing layers on the way down to ``where``."""
    return [(path, m) for path, m in on_path(model, where) if checkpointing_layer(m)]


def checkpointings(model: nn.Module, where: str) -> List[Tuple[str, str]]:
    """(path, :func:`checkpointing`) of the modules on the way down to ``where`` that have one."""
    return [(path, how) for path, m in on_path(model, where) if (how := checkpointing(m))]


def checkpointing(m: nn.Module) -> Optional[str]:
    """The gradient checkpointing that recomputes ``m`` whole in backward, or None: transformers'
    (a GradientCheckpointingLayer with it switched on), or a block ckpt_ext.plan checkpointed."""
    if getattr(m, "gradient_checkpointing", False) is True and checkpointing_layer(m):
        return "transformers' gradient checkpointing (gradient_checkpointing_enable)"
    if isinstance(vars(m).get("forward"), CheckpointedForward):
        return "the checkpoint ckpt_ext.plan(...).apply set"
    return None


def unsupported_reason(weight: Optional[torch.Tensor]) -> Optional[str]:
    if weight is None:
        return None
    if weight.dtype not in ops.SUPPORTED_DTYPES:
        return f"dtype {weight.dtype} is not supported by the fused op"
    if weight.device.type not in {"cpu", "meta"} | ({"cuda"} if _C.WITH_CUDA else set()):
        return f"device {weight.device} is not supported by this build of the fused op"
    return None


def passes_through(m: nn.Module) -> bool:
    """Whether the module returns its very input: ``nn.Identity``, or a Dropout that draws none."""
    cls = base_type(m)
    return cls is nn.Identity or (cls is nn.Dropout and not (m.p > 0 and m.training))


def passing_name(m: nn.Module) -> str:
    return f"Dropout(p={m.p}{'' if m.training else ', eval'})" if isinstance(m, nn.Dropout) \
        else base_type(m).__name__


#: whether stock autograd keeps z for each activation (its backward reads z, not the output)
SAVES_INPUT = {name: row.saves_input for name, row in REGISTRY.items()}
DISPLAY = {name: row.display for name, row in REGISTRY.items()}


def tensors_per_layer(name: str) -> int:
    """Distinct tensors stock autograd keeps per inner layer of a run that the fused op does not."""
    return REGISTRY[name].tensors_per_layer


def module_tensors(m: Optional[nn.Module], name: Optional[str], kept: Optional[int] = None) -> int:
    """:func:`tensors_per_layer` as module ``m``'s class computes it (``m`` None: a call;
    ``kept``: a call written as arithmetic, counted where it was found)."""
    if name is None:
        return 0
    if kept is not None:
        return kept
    if m is not None:
        try:
            return stock_tensors(lambda z: base_type(m).forward(m, z))
        except Exception:  # not computable on a float64 CPU tensor: the op's own count
            pass
    return tensors_per_layer(name)


class LayerKind(enum.Enum):
    LINEAR = "Linear"
    ACTIVATION = "activation"
    PASS = "pass"  # an Identity or Dropout between them, a member of a run in its owner's forward


# -- Conditions ------------------------------------------------------------------------------------

class Condition(NamedTuple):
    """What must hold for a unit to be computed fused: ``holds()``, ``describe()`` why not, and
    ``fix()`` what the user can do (None, or returning None: nothing known). ``fix`` defaults to
    None, not a function: torch.compile (2.11) cannot rebuild a default function of a tuple."""
    holds: Callable[[], bool]
    describe: Callable[[], str]
    fix: Optional[Callable[[], Optional[str]]] = None


class Slot(NamedTuple):
    """A module of a unit held where fuse found it: ``holder._modules[name] is module``."""
    holder: nn.Module
    name: str
    module: nn.Module
    label: str

    def holds(self) -> bool:
        return self.holder._modules.get(self.name) is self.module

    def describe(self) -> str:
        return f"{self.label} was replaced"


def own_forward(m: nn.Module, who: str) -> Condition:
    return Condition(lambda: not foreign_forward(m),
                     lambda: f"{who}: its forward is set on the instance (an instance forward, as "
                             f"accelerate's add_hook_to_module sets), which the fused op would "
                             f"not call",
                     lambda: hooks_fix(m))


def no_hooks(m: nn.Module, who: str, because: str = "which the fused op would not call"):
    return Condition(lambda: not has_hooks(m), lambda: f"{who} has hooks, {because}",
                     lambda: hooks_fix(m) or _OWN_HOOK_FIX)


_OWN_HOOK_FIX = ("a hook of your own: register it on the module that holds the unit, whose hooks "
                 "run around the fused op, or unfuse the model while you need it")


def elements(seq: nn.Module, label: str, names: tuple, modules: tuple) -> Condition:
    """A Sequential a unit goes through, with exactly these elements."""
    return Condition(lambda: len(seq._modules) == len(names) and all(
        name == want and m is mod for (name, m), want, mod in
        zip(seq._modules.items(), names, modules)),
        lambda: f"the elements of {label or '<model>'} changed")


def computes(m: nn.Module, label: str, name: str) -> Condition:
    """An activation module computing activation ``name``."""
    return Condition(lambda: getattr(module_activation(m), "name", None) == name,
                     lambda: f"{label} no longer computes {name}")


def of_class(m: nn.Module, label: str, classes: Tuple[type, ...]) -> Condition:
    return Condition(lambda: type(m) in classes, lambda: f"{label} changed class")


def supported(layer: nn.Module) -> Condition:
    """A Linear whose weight's dtype and device the ops take."""
    return Condition(lambda: unsupported_reason(stored_weight(layer)) is None,
                     lambda: unsupported_reason(stored_weight(layer)) or "")


def one_dtype_device(layers: Sequence[nn.Module], labels: Sequence[str]) -> Condition:
    return Condition(*linears.one_dtype_device(layers, labels))


def mask_inside(m: nn.Module, label: str, item: int) -> Condition:
    """A Dropout after ``item`` that returns its input, or follows an activation (odd item)."""
    return Condition(lambda: passes_through(m) or item % 2 == 1,
                     lambda: f"{label} (Dropout, p={m.p}) draws a mask in training between a "
                             f"Linear and its activation, which the fused run does not compute")


def masks_drawable(run: Any) -> Condition:
    """A unit whose Dropouts draw masks at this call (``run.masks()``) can draw them inside."""
    return Condition(lambda: not run.masks() or dropout_unit.unsupported() is None,
                     lambda: f"a Dropout of the run draws a mask in training and "
                             f"{dropout_unit.unsupported()}")


GLOBAL = (Condition(lambda: not torch.jit.is_tracing(),  # it records each module on its own
                    lambda: "torch.jit.trace is recording the model"),
          Condition(lambda: foreign_global_hooks() is None,  # torch's module trackers observe
                    lambda: f"{foreign_global_hooks()}, which the fused run would not call"))
ACROSS = "which a run computed across it would not call"


def at_call(lin: nn.Module, label: str) -> list:
    """Its row's checks of a Linear at each call (a LoRA Linear's peft state, a traced forward)."""
    return [Condition(*check) for check in form_of(lin).checks(lin, label)]


def of_weights(layers: Sequence[nn.Module], labels: Sequence[str]):
    return [supported(layers[0]), one_dtype_device(layers, labels)] + \
        [c for lin, label in zip(layers, labels) for c in at_call(lin, label)]


def failing(conditions: Iterable) -> Optional[str]:
    """The description of the first condition that does not hold, else None."""
    return next((c.describe() for c in conditions if not c.holds()), None)


def first_failing(conditions: Iterable) -> Optional[Condition]:
    """The first condition that does not hold, else None."""
    return next((c for c in conditions if not c.holds()), None)


def linear_problem(lin: nn.Module, read: linears.Read) -> Optional[str]:
    """What keeps a Linear from any unit, wherever it is called (``read``: its row's read of it)."""
    if foreign_forward(lin):
        return own_forward(lin, "the Linear").describe()
    return read.problem or failing([no_hooks(lin, read.who)]) or \
        unsupported_reason(read.weight) or failing(Condition(*c) for c in read.checks)


# -- The survey of a model's modules ---------------------------------------------------------------

class Fact(NamedTuple):
    """What fuse knows of one module, read once per fuse()."""
    kind: Optional[LayerKind]       # a Linear or an activation module, else None
    found: Optional[Recognised]     # what an activation module computes
    sequential: bool
    passes: bool                    # an Identity or Dropout: a run may go through it
    traced: bool                    # it has a forward of its own that fuse traces
    problem: Optional[str]          # a Linear's or activation's: what keeps it from any unit
    #: a Linear's policy.LayerShape but its label: in, out, itemsize, rank, mask, trained, cast
    width: Tuple[int, int, int, int, int, bool, int] = (0, 0, 0, 0, 0, True, 0)
    experts: bool = False           # an experts class of a mixture of experts (experts_class)
    foreign: bool = False           # its forward is set on the instance (foreign_forward)


#: torch.nn's own modules are not traced, but for a transformer layer's Python feed-forward block
_TORCH_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
#: every module class of ckpt_ext.modules computes its own fused op
OUR_MODULES = tuple(c for c in vars(_modules).values() if isinstance(c, type) and
                    issubclass(c, nn.Module) and c.__module__ == _modules.__name__)


def survey(model: nn.Module) -> Dict[int, Fact]:
    """The :class:`Fact` of every module of ``model``, by id."""
    out: Dict[int, Fact] = {}
    forms = linears.forms(model.modules())
    inside = {id(sub) for m in model.modules() if forms[id(m)] and forms[id(m)].parts
              for sub in m.modules() if sub is not m}
    reads = linears.reads([m for m in model.modules() if forms[id(m)] and id(m) not in inside],
                          forms)
    for m in model.modules():
        kind, found, problem, width = None, None, None, (0, 0, 0, 0, 0, True, 0)
        if id(m) in inside:  # a LoRA Linear's base layer and adapters: parts of that Linear
            out[id(m)] = Fact(None, None, False, False, False, None)
            continue
        cls = type(m)
        base, form = getattr(cls, "_ckpt_ext_base", cls), forms[id(m)]  # base: as base_type
        if form is not None:  # its row says how to read it (lazy: 0 bytes)
            read = reads[id(m)]
            kind, problem, width = LayerKind.LINEAR, linear_problem(m, read), read.width
        else:
            found = module_activation(m) or unmatched(m)  # unmatched: its arithmetic, why not
            if found is not None:
                kind, who = LayerKind.ACTIVATION, f"the {base.__name__}"
                problem = found.problem if found.problem is not None else \
                    failing([own_forward(m, who), no_hooks(m, who)])
        seq = base is nn.Sequential
        experts = experts_class(base)
        traced = not (seq or form is not None and not read.traced or experts or
                      isinstance(m, (nn.ModuleList, nn.ModuleDict) + OUR_MODULES) or
                      hasattr(cls, "_ckpt_ext_base") or cls.forward is nn.Module.forward or
                      cls.__module__.startswith("torch.") and cls not in _TORCH_LAYERS)
        passes = base in (nn.Identity, nn.Dropout)  # a run may go through it
        out[id(m)] = Fact(kind, found, seq, passes, traced, problem, width, experts,
                          foreign_forward(m))
    return out


# -- What each fx node of a traced forward computes ------------------------------------------------

_NONE = inspect.Parameter.empty
DROPOUT_SIGNATURE = sig(("input", _NONE), ("p", 0.5), ("training", True), ("inplace", False))
DROPOUT_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                     torch.dropout}


class NodeFact(NamedTuple):
    """What one node of a traced forward computes."""
    kind: Optional[LayerKind]       # a Linear or an activation, of any spelling
    found: Optional[Recognised]     # what an activation computes
    label: str                      # "fc1" (a child's path), "F.linear", "torch.tanh", ...
    input: Any                      # its one data input taken the usual way, else None
    child: Optional[nn.Module]      # the direct child it calls (call_module, no dotted target)
    only: Optional[fx.Node]         # its one positional node argument, else None
    # an activation written as several nodes: on its last node the others and the tensors stock
    # autograd keeps for them per layer, on its input that last node
    inner: Tuple[fx.Node, ...] = ()
    written: Optional[fx.Node] = None
    kept: Optional[int] = None


def node_facts(analysed, facts) -> Dict[fx.Node, NodeFact]:
    """What each node of each analysed forward ((path, owner, trace)) computes."""
    out: Dict[fx.Node, NodeFact] = {}
    for path, owner, t in analysed:
        for n in t.graph.nodes:
            kind = found = sub = x = None
            label = ""
            only = n.args[0] if len(n.args) == 1 and not n.kwargs and \
                isinstance(n.args[0], fx.Node) else None
            if n.op == "call_module":
                m = owner.get_submodule(n.target)
                sub = m if "." not in n.target else None
                fact = facts.get(id(m))  # not a layer: kind and found None
                kind, found = (fact.kind, fact.found) if fact is not None else (None, None)
                label = join_path(path, n.target)
            elif n.op == "call_function" and n.target in LINEAR_FUNCTIONS:
                try:
                    x, w, b = linear_args(n)
                    kind, label = LayerKind.LINEAR, "F.linear"
                    x = x if all(a is not x for a in (w, b)) else None
                except TypeError:
                    pass
            else:
                act = node_activation(n)
                if act is not None:
                    kind, (found, x, label) = LayerKind.ACTIVATION, act
            if n.op == "call_module" or (kind is None and label == ""):
                x = n.args[0] if len(n.args) == 1 and not n.kwargs else None
            out[n] = NodeFact(kind, found, label, x, sub, only)
        order = {n: i for i, n in enumerate(t.graph.nodes)}
        for n in t.graph.nodes:
            written = written_after(n, order) if out[n].kind is LayerKind.LINEAR else None
            if written is not None:
                last, inner, found, kept = written
                out[last] = out[last]._replace(kind=LayerKind.ACTIVATION, input=n, inner=inner,
                                               kept=kept, found=Recognised(found.name),
                                               label=found.form)
                out[n] = out[n]._replace(written=last)
    return out


# -- What an op or module does with its input: keeps it, frees it, views it, reads its size --------

def _acts(saves_input: bool, field: str) -> set:
    return {getattr(c, "fn", c) for r in REGISTRY.values() if r.saves_input == saves_input
            for c in getattr(r, field)}


def _act_modules(saves_input: bool) -> tuple:
    return tuple({f.cls for r in REGISTRY.values() if r.saves_input == saves_input
                  for f in r.modules if isinstance(f.cls, type)})


VIEW_FUNCTIONS = {operator.getitem, torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze,
                  torch.transpose, torch.permute, torch.narrow, torch.select, torch.chunk,
                  torch.split, torch.unbind, torch.t}
VIEW_METHODS = {"view", "reshape", "flatten", "unsqueeze", "squeeze", "permute", "transpose", "t",
                "contiguous", "expand", "expand_as", "view_as", "reshape_as", "narrow", "select",
                "unflatten", "chunk", "split", "unbind", "to", "float", "double", "half",
                "bfloat16", "type_as", "detach"}
META_FUNCTIONS, META_METHODS = {getattr, len}, {"size", "dim", "numel", "stride", "ndimension"}
FREEING_FUNCTIONS = {operator.add, operator.sub, operator.iadd, operator.isub, operator.neg,
                     torch.add, torch.sub, torch.neg, torch.cat, torch.concat, torch.stack,
                     torch.sum, torch.mean, torch.clone, F.softmax, F.log_softmax,
                     torch.softmax} | _acts(False, "calls")
FREEING_METHODS = {"add", "sub", "add_", "sub_", "neg", "sum", "mean", "clone", "softmax",
                   "log_softmax"} | _acts(False, "methods")
SCALING_FUNCTIONS = {operator.mul, operator.truediv, operator.imul, operator.itruediv,
                     torch.mul, torch.div}
SCALING_METHODS = {"mul", "div", "mul_", "div_"}
KEEPING_FUNCTIONS = {*LINEAR_FUNCTIONS, torch.matmul, torch.mm, torch.bmm, operator.matmul,
                     torch.einsum, F.layer_norm, F.mse_loss, torch.pow, operator.pow,
                     *ops.PUBLIC_OPS} | _acts(True, "calls")
KEEPING_METHODS = {"matmul", "mm", "bmm", "pow"} | _acts(True, "methods")
PASS_THROUGH_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten)
FREEING_MODULES = (nn.Softmax, nn.LogSoftmax) + _act_modules(False)
KEEPING_MODULES = (nn.Linear, nn.Bilinear, nn.LayerNorm, nn.GroupNorm, nn.MultiheadAttention,
                   nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm) + OUR_MODULES + \
    _act_modules(True)
