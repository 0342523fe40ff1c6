"""Code generation for ``rewrite=True``: the graph of a forward with each planned unit's nodes
replaced by one ``tanh_mlp`` / ``linear_tanh`` call (``mlp`` for the other activations and mixed
runs), as Python source that the owner's :class:`_OwnerForward` compiles (and pickles by)."""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

from torch import fx, nn

from .. import ops
from ..modules import as_mlp_argument
from ..ops import linear_tanh, tanh_mlp
from .discovery import data_input, getattr_path, linear_args
from .planning import ModelPlan
from .policy import Unit
from .report import FuseReport
from .runtime import is_conv1d


def rewrite_forwards(plan: ModelPlan, report: FuseReport) -> Dict[int, str]:
    """The source of each planned rewrite, by id of its module. A rewrite that fails is refused
    rather than guessed: its forward is left alone, and the report says why."""
    sources: Dict[int, str] = {}
    for path, m, t, units in plan.rewrites:
        try:
            sources[id(m)] = _rewrite_source(m, t.graph, units, t.counts)
        except Exception as e:
            report.rewritten.remove(path)
            report.not_analysed.append((path, f"forward not rewritten: {type(e).__name__}: {e}"))
            plan.refuse(units, str(e))
    return sources


def _rewrite_source(owner: nn.Module, graph: fx.Graph, units: Sequence[Unit],
                    counts: Sequence[Tuple[str, str, int]] = ()) -> str:
    """Replace each unit's nodes by one fused call; return the source of the new forward, which
    first adds to each count (path, name, delta) what a call of the class's forward adds."""
    for u in units:
        s, e = u.chain.span(u.first, u.last, u.last_act)
        nodes = u.chain.items[s:e]
        lins = nodes[0::2]
        x = data_input(lins[0])
        with graph.inserting_before(nodes[-1]):  # after every weight's own get_attr
            ws, bs = [], []
            for n in lins:
                if n.op == "call_module":
                    sub = owner.get_submodule(n.target)
                    w = graph.get_attr(f"{n.target}.weight")
                    ws.append(graph.call_method("t", (w,)) if is_conv1d(sub) else w)
                    bs.append(graph.get_attr(f"{n.target}.bias") if sub.bias is not None else None)
                else:
                    _, w, b = linear_args(n)
                    ws.append(w)
                    bs.append(b)
            if u.activation != "tanh":  # another name, or one per layer
                new = graph.call_function(ops.mlp, (x, ws, bs), {
                    "activation": as_mlp_argument(u.activation), "last_activation": u.last_act})
            elif len(lins) == 1 and u.last_act:
                new = graph.call_function(linear_tanh, (x, ws[0], bs[0]))
            else:
                new = graph.call_function(tanh_mlp, (x, ws, bs, u.last_act))
        nodes[-1].replace_all_uses_with(new)
        for n in reversed(nodes):
            graph.erase_node(n)
    graph.lint()
    for n in graph.nodes:
        if n.op == "get_attr":
            getattr_path(owner, n.target)  # AttributeError: a constant fx made on the copy
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
