"""What a plan chooses among: its units and each unit's options.

A *block* is an element of a ``ModuleList`` or ``Sequential`` of two or more modules of one class
(a transformer's layers), not inside another block; its options are the rows of :data:`OPTIONS`:
``none``; ``fuse`` (every unit ``fuse`` would make inside it); ``checkpoint`` (stock
non-reentrant ``torch.utils.checkpoint`` of the whole block); ``pointwise`` (the block under
selective checkpointing that keeps every GEMM's and attention's output and recomputes the rest:
recompute.py); ``fuse+pointwise`` and ``fuse+checkpoint`` (fuse, then that recompute). A
unit ``fuse`` would make outside every block is a unit of its own, named by the module whose
forward holds it (its ``where``), with ``none`` and ``fuse``. The *head* (a causal LM's
output embeddings and its loss, after every block) takes ``none`` or ``fused loss``
(``ckpt_ext._head_loss``). The probe (probe.py) drops units it cannot delimit in the step, and
says why."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .._block_checkpoint import checkpoint_block
from .._head_loss import fuse_head_loss, head_of, head_refusal
from ..convert import fuse
from .recompute import pointwise_block


class Option(str, enum.Enum):
    """What a plan does with a unit (a ``str``: it prints, compares and hashes as its value)."""
    NONE = "none"
    FUSE = "fuse"
    CHECKPOINT = "checkpoint"
    POINTWISE = "pointwise"
    FUSE_POINTWISE = "fuse+pointwise"
    FUSE_CHECKPOINT = "fuse+checkpoint"
    FUSED_LOSS = "fused loss"


@dataclass(frozen=True)
class OptionRow:
    """What an option does to a block: fuse the units inside it (``fuses``), then set a
    recomputing forward on its instance (``recompute(block)``, or None); or, to the head, what
    ``head(model)`` sets. ``short``: its letters in a configuration's name."""
    fuses: bool
    recompute: Optional[Callable[[nn.Module], None]]
    short: str
    head: Optional[Callable[[nn.Module], None]] = None

    @property
    def fuses_inside_recompute(self) -> bool:
        """A fused MLP inside a recomputed block."""
        return self.fuses and self.recompute is not None


#: The options, one row each: the probe measures a step per row, the solver chooses among them,
#: Plan.apply puts them in.
OPTIONS: Dict[Option, OptionRow] = {
    Option.NONE: OptionRow(fuses=False, recompute=None, short="n"),
    Option.FUSE: OptionRow(fuses=True, recompute=None, short="f"),
    Option.CHECKPOINT: OptionRow(fuses=False, recompute=checkpoint_block, short="c"),
    Option.POINTWISE: OptionRow(fuses=False, recompute=pointwise_block, short="p"),
    Option.FUSE_POINTWISE: OptionRow(fuses=True, recompute=pointwise_block, short="fp"),
    Option.FUSE_CHECKPOINT: OptionRow(fuses=True, recompute=checkpoint_block, short="fc"),
    Option.FUSED_LOSS: OptionRow(fuses=False, recompute=None, short="l", head=fuse_head_loss),
}
#: The options a block takes (the head's are those with ``head``, and none).
BLOCK_OPTIONS = tuple(o for o in Option if OPTIONS[o].head is None)


def recomputing(option: Option) -> bool:
    return OPTIONS[option].recompute is not None


class Kind(str, enum.Enum):
    """What a unit is: a block, a unit ``fuse`` makes outside every block, or the head."""
    BLOCK = "block"
    FUSED = "fused unit"
    HEAD = "head"


@dataclass
class Unit:
    path: str                                   # module path ("" = the model)
    kind: Kind
    options: Tuple[Option, ...]
    #: the modules whose ``fuse(module)`` makes this unit's fused units, and the layers (paths
    #: from the model) each must fuse
    fuse_targets: Tuple[Tuple[str, Tuple[Tuple[str, ...], ...]], ...] = ()
    cls: str = ""                               # the module's class, checked by Plan.apply
    why_not: Dict[Option, str] = field(default_factory=dict)  # options left out, and why


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _inside(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def repeated_blocks(model: nn.Module) -> List[str]:
    """Paths of the elements of every ModuleList/Sequential of two or more modules of one class,
    outermost first, none inside another."""
    found: List[str] = []
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or \
                any(_inside(path, b) for b in found):
            continue
        children = list(m.named_children())
        classes = {type(c) for _, c in children}
        if len(children) >= 2 and len(classes) == 1 and \
                any(True for _ in children[0][1].parameters()):
            found += [join_path(path, name) for name, _ in children]
    return found


def _targets_of(model: nn.Module, decisions) -> Dict[str, List[Tuple[str, ...]]]:
    """The fused decisions of a dry run, by the module whose forward holds them."""
    out: Dict[str, List[Tuple[str, ...]]] = {}
    for d in decisions:
        if d.action == "fused":
            out.setdefault(d.where, []).append(tuple(d.layers))
    return out


def fuses_alone(model: nn.Module, where: str, layers: List[Tuple[str, ...]]) -> Optional[str]:
    """None when ``fuse(model.get_submodule(where))`` makes exactly these units, else why not."""
    sub = model.get_submodule(where)
    got = sorted(tuple(join_path(where, layer) for layer in d.layers)
                 for d in fuse(sub, dry_run=True).report.decisions if d.action == "fused")
    if got != sorted(layers):
        return (f"fuse({where or '<model>'}) on its own would fuse {got or 'nothing'}, not "
                f"{sorted(layers)}")
    return None


def find_units(model: nn.Module) -> Tuple[List[Unit], List[Tuple[str, str]]]:
    """The model's units in module order, and (path, why) for what cannot be a unit."""
    notes: List[Tuple[str, str]] = []
    targets = _targets_of(model, fuse(model, dry_run=True).report.decisions)
    blocks = repeated_blocks(model)
    # A fused unit whose layers lie partly inside a block makes that block's list no block list.
    for where, runs in targets.items():
        for layers in runs:
            for b in list(blocks):
                inside = [_inside(layer, b) for layer in layers]
                if any(inside) and not (all(inside) and _inside(where, b)):
                    notes.append((b, f"the fused unit {' -> '.join(layers)} crosses its edge"))
                    blocks.remove(b)
    units: List[Unit] = []
    placed = set()
    for b in blocks:
        block = model.get_submodule(b)
        mine = {w: r for w, r in targets.items() if _inside(w, b)}
        why: Dict[Option, str] = {}
        for w, runs in mine.items():
            problem = fuses_alone(model, w, runs)
            if problem:
                why[Option.FUSE] = problem
        if not mine:
            why[Option.FUSE] = "fuse makes no unit inside it"
        if b in mine:
            for o in BLOCK_OPTIONS:
                if OPTIONS[o].fuses_inside_recompute:
                    why[o] = ("fuse sets the block's own forward, which a recompute set on it "
                              "would bypass")
        norms = [n for n, m in block.named_modules() if isinstance(m, _BatchNorm) and
                 m.training and m.track_running_stats]
        if norms:
            for o in BLOCK_OPTIONS:
                if recomputing(o):
                    why[o] = (f"{join_path(b, norms[0])} updates its running statistics in "
                              f"training: a recompute would update them twice")
        if "forward" in vars(block):
            for o in BLOCK_OPTIONS:
                if recomputing(o):
                    why.setdefault(o, f"a forward is set on its instance "
                                      f"({type(vars(block)['forward']).__name__}), which a "
                                      f"recompute set on it would bypass")
        if Option.FUSE in why:
            for o in BLOCK_OPTIONS:
                if o != Option.FUSE and OPTIONS[o].fuses:
                    why.setdefault(o, why[Option.FUSE])
        options = tuple(o for o in BLOCK_OPTIONS if o not in why)
        units.append(Unit(b, Kind.BLOCK, options,
                          tuple((w, tuple(r)) for w, r in mine.items()) if Option.FUSE in options
                          else (), type(block).__name__, why))
        placed.update(mine)
    for where, runs in targets.items():
        if where in placed or any(_inside(where, b) for b in blocks):
            continue
        problem = fuses_alone(model, where, runs)
        if problem:
            notes.append((where, problem))
            continue
        units.append(Unit(where, Kind.FUSED, (Option.NONE, Option.FUSE),
                          ((where, tuple(runs)),), type(model.get_submodule(where)).__name__))
    order = {path: i for i, (path, _) in enumerate(model.named_modules(remove_duplicate=False))}
    units.sort(key=lambda u: order.get(u.path, -1))
    return units, notes


def find_head(model: nn.Module) -> Tuple[Optional[Unit], List[Tuple[str, str]]]:
    """The model's head as a unit (``none``, ``fused loss``), or None and, for a model that has
    output embeddings, why it is no unit."""
    path, head = head_of(model)
    if head is None:
        return None, []
    why = head_refusal(model)
    if why is not None:
        return None, [(path, f"its loss is not fused with it: {why}")]
    return Unit(path, Kind.HEAD, (Option.NONE, Option.FUSED_LOSS), (),
                type(head).__name__), []
