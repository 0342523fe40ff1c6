"""What the converter knows of modules, activations and ops, in one place: which module is a
Linear of a run (``nn.Linear``, transformers' ``Conv1D``) and its weight as stored, which module
or call computes which activation of ``ckpt_ext.ACTIVATIONS`` (read from the registry's rows,
ckpt_ext/_activations.py), which modules return their input, and what an op or module does with
the tensor it is given (keeps it for backward, frees it, views it): the tables the fates of
values read. Derived from the registry and the ops wherever they can be; nothing here is
evaluated on the user's tensors."""
from __future__ import annotations

import inspect
import operator
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.parameter import UninitializedTensorMixin
from torch.nn.utils import parametrize

from .. import _C, modules as _modules, ops
from .._activation_modules import Recognised, module_activation
from .._activations import REGISTRY, CallForm, stock_tensors
from ..modules import _has_hooks as has_hooks  # noqa: F401  (the one hooks test)

__all__ = ["Recognised", "module_activation", "has_hooks"]


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class SetByFuse:
    """The base of what fuse sets on a module instance (runtime's owner forward): any other
    ``forward`` on an instance is someone else's."""


def foreign_forward(m: nn.Module) -> bool:
    """Whether someone other than fuse set ``forward`` on this instance (accelerate's
    ``add_hook_to_module`` does): a fused op computing this module's output would not call it."""
    fwd = vars(m).get("forward")
    return fwd is not None and not isinstance(fwd, SetByFuse)


def base_type(m: nn.Module) -> type:
    """The module's class, or the class fuse gave it a member class (or FusedSequential) of."""
    return getattr(type(m), "_ckpt_ext_base", type(m))


def is_sequential(m: Any) -> bool:
    return isinstance(m, nn.Module) and base_type(m) is nn.Sequential


# ------------------------------------------------------------------------------------------------
# Linears: nn.Linear and transformers' Conv1D (x·W + b, W stored (in, out))

def conv1d_class(cls: type) -> bool:
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def is_conv1d(m: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projections)."""
    return conv1d_class(base_type(m))


def is_linear(m: Any) -> bool:
    """A Linear of a run: an ``nn.Linear`` (any subclass: ``linear_problem`` says which it
    refuses) or a transformers ``Conv1D``."""
    return isinstance(m, nn.Linear) or (isinstance(m, nn.Module) and is_conv1d(m))


def stored_weight(lin: nn.Module) -> Optional[torch.Tensor]:
    """The tensor a Linear's weight is stored in, read without evaluating anything: the parameter,
    or a parametrization's original (whose dtype and device the computed weight has). None for a
    lazy, uninitialised parameter."""
    w = lin._parameters.get("weight")
    if w is None and parametrize.is_parametrized(lin, "weight"):
        w = next(iter(lin.parametrizations["weight"].parameters()), None)
    return None if w is None or isinstance(w, UninitializedTensorMixin) else w


def linear_weight(lin: nn.Module) -> torch.Tensor:
    """The weight as the ops take it, (out, in): a Conv1D's transposed, a view (the ops compute
    with either layout and give its gradient that layout)."""
    return lin.weight.t() if is_conv1d(lin) else lin.weight


def features(lin: nn.Module) -> Tuple[int, int]:
    """(in, out) features of a Linear or a Conv1D."""
    return tuple(lin.weight.shape) if is_conv1d(lin) else (lin.in_features, lin.out_features)


def unsupported_reason(weight: Optional[torch.Tensor]) -> Optional[str]:
    """None when the ops run on this weight's device and dtype, else why not."""
    if weight is None:
        return None
    if weight.dtype not in ops.SUPPORTED_DTYPES:
        return f"dtype {weight.dtype} is not supported by the fused op"
    if weight.device.type not in {"cpu", "meta"} | ({"cuda"} if _C.WITH_CUDA else set()):
        return f"device {weight.device} is not supported by this build of the fused op"
    return None


INSTANCE_FORWARD = ("its forward is set on the instance (an instance forward, as accelerate's "
                    "add_hook_to_module sets), which the fused op would not call")


# ------------------------------------------------------------------------------------------------
# Modules a run may go through: Identity and Dropout

def passes_through(m: nn.Module) -> bool:
    """Whether the module returns its input, the very tensor: ``nn.Identity``, or an
    ``nn.Dropout`` with p = 0 or in eval()."""
    cls = base_type(m)
    return cls is nn.Identity or (cls is nn.Dropout and not (m.p > 0 and m.training))


def may_pass(m: nn.Module) -> bool:
    """Whether a run may go through the module: ``nn.Identity`` or ``nn.Dropout``."""
    return base_type(m) in (nn.Identity, nn.Dropout)


def draws_mask(m: nn.Module) -> bool:
    return isinstance(m, nn.Dropout) and m.p > 0 and m.training


def passing_name(m: nn.Module) -> str:
    return f"Dropout(p={m.p}{'' if m.training else ', eval'})" if isinstance(m, nn.Dropout) \
        else base_type(m).__name__


# ------------------------------------------------------------------------------------------------
# Activations: the registry's rows, as modules and as calls in forward code

#: Whether stock autograd keeps z for each activation (its backward reads z, not the output).
SAVES_INPUT = {name: row.saves_input for name, row in REGISTRY.items()}
DISPLAY = {name: row.display for name, row in REGISTRY.items()}


def tensors_per_layer(name: str) -> int:
    """Distinct tensors stock autograd keeps per inner layer of a run that the fused op does not."""
    return REGISTRY[name].tensors_per_layer


def module_tensors(m: Optional[nn.Module], name: Optional[str]) -> int:
    """:func:`tensors_per_layer` for an activation as it is called: by module ``m`` as its class
    computes it (a formula of several ops, transformers' ``NewGELUActivation``, keeps more than
    the one op: its class's forward runs on 8 values), or by a call (``m`` None: the op's own
    count); 0 where it computes no activation."""
    if name is None:
        return 0
    if m is None:
        return tensors_per_layer(name)
    cls = base_type(m)
    try:
        return stock_tensors(lambda z: cls.forward(m, z))
    except Exception:  # not computable on a float64 CPU tensor: the op's own count
        return tensors_per_layer(name)


def _sig(*params: Tuple[str, Any]) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                default=d) for p, d in params])


_INPUT = ("input", inspect.Parameter.empty)


def _reader(forms: List[Tuple[str, CallForm]]) -> Callable[[Dict[str, Any]], Recognised]:
    """The activation whose form's wanted values the call's other arguments have, else why not."""
    def read(args: Dict[str, Any]) -> Recognised:
        for name, form in forms:
            if all(args[k] == v for k, v in form.want.items()):
                return Recognised(name)
        shown = ", ".join(f"{a}={args[a]!r}" for a in forms[0][1].want)
        wanted = " or ".join(f"{name} with " + ", ".join(f"{a}={b!r}" for a, b in f.want.items())
                             for name, f in forms)
        return Recognised(None, f"called with {shown}: the fused op computes {wanted}")
    return read


def _call_table():
    forms: Dict[Any, List[Tuple[str, CallForm]]] = {}
    for row in REGISTRY.values():
        for form in row.calls:
            forms.setdefault(form.fn, []).append((row.name, form))
    return {fn: (fs[0][1].label, _sig(_INPUT, *fs[0][1].params), _reader(fs))
            for fn, fs in forms.items()}


_FUNCTIONS = _call_table()
_METHODS = {meth: row.name for row in REGISTRY.values() for meth in row.methods}


def bind(node: fx.Node, sig: inspect.Signature) -> Optional[Dict[str, Any]]:
    """The node's arguments bound to ``sig`` with defaults applied; None if they do not bind."""
    try:
        bound = sig.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def node_activation(node: fx.Node) -> Optional[Tuple[Recognised, Any, str]]:
    """(what it computes, its data input, its label) for an activation call in an fx graph; None
    when the node is no activation call fuse knows, or takes other tensors."""
    if node.op == "call_function" and node.target in _FUNCTIONS:
        label, sig, read = _FUNCTIONS[node.target]
    elif node.op == "call_method" and node.target in _METHODS:
        label, sig = f".{node.target}()", _sig(_INPUT)
        read = _reader([(_METHODS[node.target], CallForm(None, label))])
    else:
        return None
    args = bind(node, sig)
    if args is None:
        return None
    x = args.pop("input")
    if any(isinstance(v, fx.Node) for v in args.values()):
        return None
    return read(args), x, label


# ------------------------------------------------------------------------------------------------
# Linears in forward code, and what a node of any spelling is

LINEAR_FUNCTIONS = (F.linear, torch._C._nn.linear)
LINEAR_SIGNATURE = _sig(_INPUT, ("weight", inspect.Parameter.empty), ("bias", None))
DROPOUT_SIGNATURE = _sig(_INPUT, ("p", 0.5), ("training", True), ("inplace", False))
DROPOUT_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                     torch.dropout}


def linear_args(node: fx.Node):
    """(input, weight, bias) of an ``F.linear`` call; TypeError when they do not bind."""
    bound = LINEAR_SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return bound.arguments["input"], bound.arguments["weight"], bound.arguments["bias"]


def data_input(node: fx.Node) -> Any:
    """The node's tensor input if it takes exactly one data input the usual way, else None."""
    if node.op == "call_function" and node.target in LINEAR_FUNCTIONS:
        x, w, b = linear_args(node)
        return x if all(a is not x for a in (w, b)) else None
    if node.op != "call_module":
        found = node_activation(node)
        if found is not None:
            return found[1]
    if len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    return None


def node_label(node: fx.Node, owner_path: str) -> str:
    if node.op == "call_module":
        return join_path(owner_path, node.target)
    if node.op == "call_function" and node.target in LINEAR_FUNCTIONS:
        return "F.linear"
    return node_activation(node)[2]


def one_input(n: fx.Node) -> Optional[fx.Node]:
    return n.args[0] if len(n.args) == 1 and not n.kwargs and isinstance(n.args[0], fx.Node) \
        else None


def child(owner: nn.Module, n: Any, test: Callable[[nn.Module], bool]) -> Optional[nn.Module]:
    """The direct child ``n`` calls, when ``n`` is a call_module node of one that passes
    ``test``."""
    if not isinstance(n, fx.Node) or n.op != "call_module" or "." in n.target:
        return None
    sub = owner._modules.get(n.target)
    return sub if sub is not None and test(sub) else None


def activation_of(owner: nn.Module, n: fx.Node) -> Optional[Tuple[Recognised, Any]]:
    """(what it computes, its child module or None for a call) when ``n`` is an activation."""
    if n.op == "call_module":
        sub = owner._modules.get(n.target) if "." not in n.target else None
        found = module_activation(sub) if sub is not None else None
        return (found, sub) if found is not None else None
    found = node_activation(n)
    return (found[0], None) if found is not None else None


# ------------------------------------------------------------------------------------------------
# What an op or module does with a tensor it is given: keeps it for backward (a Linear, a
# matmul), frees it (an add, a Tanh, a .mean()), views it, or only reads its metadata. From the
# registry's rows (what each activation's backward reads) and the ops' own list.

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
#: the fused ops keep their input x, as a Linear does
KEEPING_FUNCTIONS = {*LINEAR_FUNCTIONS, torch.matmul, torch.mm, torch.bmm, operator.matmul,
                     torch.einsum, F.layer_norm, F.mse_loss, torch.pow, operator.pow,
                     *ops.PUBLIC_OPS} | _acts(True, "calls")
KEEPING_METHODS = {"matmul", "mm", "bmm", "pow"} | _acts(True, "methods")
PASS_THROUGH_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten)
FREEING_MODULES = (nn.Softmax, nn.LogSoftmax) + _act_modules(False)
#: every module class of ckpt_ext.modules keeps its input, as an nn.Linear does
OUR_MODULES = tuple(c for c in vars(_modules).values() if isinstance(c, type) and
                    issubclass(c, nn.Module) and c.__module__ == _modules.__name__)
KEEPING_MODULES = (nn.Linear, nn.Bilinear, nn.LayerNorm, nn.GroupNorm, nn.MultiheadAttention,
                   nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm) + OUR_MODULES + \
    _act_modules(True)
