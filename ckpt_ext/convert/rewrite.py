"""The rewrite kind (``rewrite=True``): chains holding a function call or a Linear held in a list,
fused by generating the forward's code from its graph; otherwise near misses."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import fx, nn
from torch.nn.utils import parametrize

from ..modules import as_mlp_argument
from .. import ops
from .facts import LayerKind, module_tensors, unsupported_reason
from .linears import form_of, linear_args
from .graph import ModelGraph
from .policy import Chain, LayerShape, Unit, decide, item_misses
from .report import Action, Decision, How
from .tracing import Trace
from .units import Options, Placement, UnitKind
from .engines import real_shape


@dataclass
class ForwardChains:
    """The chains of one module's forward that hold a function call, and their near misses."""
    path: str
    owner: nn.Module
    trace: Trace
    chains: List[Chain] = field(default_factory=list)
    misses: List[Decision] = field(default_factory=list)
    not_analysed: List[Tuple[str, str]] = field(default_factory=list)  # a rewrite that failed

    @property
    def takes(self) -> List[fx.Node]:
        return [x for chain in self.chains for x in chain.items if x.op == "call_module"]


def _stored_attr(root: nn.Module, target: str) -> Any:
    """``getattr`` along a dotted path; a parametrized attribute gives its stored original."""
    *parents, name = target.split(".")
    obj = functools.reduce(getattr, parents, root)
    if isinstance(obj, nn.Module) and parametrize.is_parametrized(obj, name):
        return next(iter(obj.parametrizations[name].parameters()), None)
    return getattr(obj, name)


def forward_chains(graph: ModelGraph, path: str, owner: nn.Module, t: Trace, rewrite: bool, taken):
    """The chains of one forward that hold a function call or a Linear held in a list."""
    facts = graph.nodes
    kind = {n: None if n in taken else facts[n].kind for n in t.graph.nodes}
    where = path or "<model>"

    def nxt(n: fx.Node) -> Optional[fx.Node]:
        users = [facts[n].written] if facts[n].written is not None else list(n.users)
        if len(users) != 1:
            return None
        u, = users
        want = LayerKind.ACTIVATION if kind[n] is LayerKind.LINEAR else LayerKind.LINEAR
        return u if kind[u] == want and facts[u].input is n else None

    def own_problem(n: fx.Node) -> Optional[str]:
        """What the layer itself keeps from being fused, wherever it is called."""
        if n.op == "call_module":
            sub = owner.get_submodule(n.target)
            why = getattr(form_of(sub), "not_rewritten", None)  # sub: a Linear or activation
            return graph.facts[id(sub)].problem or (f"{facts[n].label} is {why}" if why else None)
        if kind[n] is LayerKind.ACTIVATION:
            return facts[n].found.problem
        _, w, _ = linear_args(n)
        if not (isinstance(w, fx.Node) and w.op == "get_attr"):
            return f"{facts[n].label}'s weight is not an attribute of {where}"
        return unsupported_reason(_stored_attr(owner, w.target))

    def member_problem(n: fx.Node) -> Optional[str]:
        label = facts[n].label
        if n.op != "call_module":
            return (f"{label} is a function call: fusing it rewrites {where}.forward"
                    + ("" if rewrite else "; pass rewrite=True to allow that"))
        if "." in n.target:
            return f"{label} is not a direct child of {where}"
        return graph.child_problem(owner, t, n.target, label, owner.get_submodule(n.target)) \
            or own_problem(n)

    def layer_of(n: fx.Node) -> Optional[LayerShape]:
        if n.op == "call_module":
            return LayerShape(facts[n].label, *graph.facts[id(owner.get_submodule(n.target))].width)
        _, w, _ = linear_args(n)
        if isinstance(w, fx.Node) and w.op == "get_attr":
            wt = _stored_attr(owner, w.target)
            out_f, in_f = real_shape(wt)
            return LayerShape("F.linear", in_f, out_f, wt.element_size())
        return None

    has_prev = {nxt(n) for n in t.graph.nodes if kind[n] is not None} - {None}
    out = ForwardChains(path, owner, t)
    for n in t.graph.nodes:
        if kind[n] is LayerKind.LINEAR and len(n.users) > 1 and facts[n].written is None and \
                any(kind[u] is LayerKind.ACTIVATION for u in n.users):
            out.misses.append(Decision(
                where=path, layers=(facts[n].label,), action=Action.LEFT_ALONE,
                why=f"its output has {len(n.users)} users, so it is kept for the others anyway"))
        if kind[n] is not LayerKind.LINEAR or n in has_prev or nxt(n) is None:
            continue
        items = [n]
        while nxt(items[-1]) is not None:
            items.append(nxt(items[-1]))
        only = [x.op != "call_module" or "." in x.target for x in items]
        if not any(only):
            continue  # module calls only: another kind's
        labels = [facts[x].label for x in items]
        rw = [f"{where}.forward cannot be rewritten: {t.rewrite_problem}"
              if t.rewrite_problem is not None else own_problem(x) for x in items]
        layers = [layer_of(x) for x in items[0::2]]
        if rewrite and all(p is None for p in rw) and all(lay is not None for lay in layers):
            names = tuple(facts[x].found.name for x in items[1::2])
            modules = [owner.get_submodule(x.target) if x.op == "call_module" else None
                       for x in items[1::2]]
            kept = [facts[x].kept for x in items[1::2]]
            out.chains.append(Chain(
                path, How.REWRITE, labels, items, layers, names, len(items) % 2 == 0,
                lambda last=items[-1]: graph.fate(owner, last),
                tuple(module_tensors(*args) for args in zip(modules, names, kept))))
            continue
        # not rewritten: misses for pairs holding a call or a listed Linear (children: other kinds')
        problems = [rw[k] if (rewrite and rw[k] is not None) else member_problem(x)
                    for k, x in enumerate(items)]
        in_pair = [only[k - k % 2] or (k - k % 2 + 1 < len(items) and only[k - k % 2 + 1])
                   for k in range(len(items))]
        out.misses.extend(item_misses(path, labels, [p if in_pair[k] else None
                                                     for k, p in enumerate(problems)]))
    return out


class Rewrite(UnitKind):
    def find(self, graph: ModelGraph, taken: set, options: Options) -> List[ForwardChains]:
        found = [forward_chains(graph, path, m, t, options.rewrite, taken)
                 for path, m, t in graph.analysed if not t.already_rewritten]
        return [f for f in found if f.chains or f.misses]

    def decide(self, graph: ModelGraph, f: ForwardChains, options: Options):
        decided = [decide(chain, options.policy) for chain in f.chains]
        return [u for us, _ in decided for u in us], [d for _, ds in decided for d in ds] + f.misses

    def place(self, graph: ModelGraph, f: ForwardChains, units: Sequence[Unit], misses):
        left = [(d, None) for d in misses]
        if not units:
            return left
        try:
            source = _rewritten(f.owner, f.trace.graph, graph.nodes, units, f.trace.counts)
        except Exception as e:  # refused rather than guessed: the forward is left alone
            f.not_analysed.append((f.path, f"forward not rewritten: {type(e).__name__}: {e}"))
            return [(dataclasses.replace(u.decision, action=Action.LEFT_ALONE, unit="",
                                         how=How.NOWHERE, why=f"the forward rewrite failed: {e}"),
                     None) for u in units] + left
        p = Placement(How.REWRITE, f.path, [], "", False, self, f, owner=f.owner, source=source)
        return [(u.decision, p) for u in units] + left


def _rewritten(owner: nn.Module, traced: fx.Graph, nodes, units: Sequence[Unit], counts=()) -> str:
    """``owner``'s forward with each unit one fused call, replaying each count's delta."""
    graph = fx.Graph()
    copied: Dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(traced, copied))
    for u in units:
        items = [copied[n] for n in u.items]
        lins = items[0::2]
        x = nodes[u.items[0]].input  # the first Linear's data input
        x = copied[x] if isinstance(x, fx.Node) else x
        with graph.inserting_before(items[-1]):  # after every weight's own get_attr
            ws, bs = [], []
            for n in lins:
                if n.op == "call_module":
                    sub = owner.get_submodule(n.target)
                    w = graph.get_attr(f"{n.target}.weight")
                    ws.append(graph.call_method("t", (w,)) if form_of(sub).transposed else w)
                    bs.append(graph.get_attr(f"{n.target}.bias") if sub.bias is not None else None)
                else:
                    _, w, b = linear_args(n)
                    ws.append(w)
                    bs.append(b)
            fn = ops.named_form(u.activation, len(lins), u.last_act)
            if fn is ops.mlp:
                new = graph.call_function(fn, (x, ws, bs), {
                    "activation": as_mlp_argument(u.activation), "last_activation": u.last_act})
            elif fn is ops.linear_tanh:
                new = graph.call_function(fn, (x, ws[0], bs[0]))
            else:
                new = graph.call_function(fn, (x, ws, bs, u.last_act))
        items[-1].replace_all_uses_with(new)
        for n in reversed([copied[x] for n in u.items for x in (*nodes[n].inner, n)]):
            graph.erase_node(n)  # an activation written as arithmetic: its nodes too
    graph.lint()
    for n in graph.nodes:  # an AttributeError: a get_attr of a constant fx made on the copy
        if n.op == "get_attr":
            functools.reduce(getattr, n.target.split("."), owner)
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer
    code = graph.python_code(root_module="self")
    src = code.src
    if counts:
        head, sep, body = src.partition("):\n")  # after the def line
        replay = "".join(f"    _ckpt_ext_m = self.get_submodule({path!r}); "
                         f"_ckpt_ext_m.{name} = _ckpt_ext_m.{name} + {delta!r}\n"
                         for path, name, delta in counts)
        src = head + sep + replay + body
    return _format_import_block(code.globals, sys_importer) + "\n" + src


REWRITE = Rewrite()
