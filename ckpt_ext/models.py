"""The write-up's network and more, each in the modes a user would pick between (``plain``,
``checkpoint``, ``checkpoint-stack``, ``fused``): :class:`Net` (the write-up's chain: ``linear1``,
then ``block1..blockN = Sequential(Linear(H, H), Tanh())``, loss ``output.mean()``),
:class:`ResidualNet` (``h + tanh(Linear(h))``), :class:`MLPNet` (``h + Linear(4H, H)(tanh(Linear(H,
4H)(h)))``), :class:`BertMLPNet` (BERT's ``LayerNorm(h + Linear(H, W)(gelu(Linear(W, H)(h))))``),
:class:`LlamaMLPNet` (Llama's ``h + down(silu(gate(n)) * up(n))``, ``n = RMSNorm(h)``)
with LoRA adapters on frozen weights (:class:`LlamaLoRANet`), a mixture of experts
(:class:`MoENet`, transformers' Mixtral experts and router) and :class:`PINNNet` (``2 -> H x D ->
1`` with any activation, a heat-equation loss needing ``u_xx``: a double backward). Every mode
shares ``nn.Linear``'s initialisation and ``state_dict`` keys, so modes load one another's
weights; :func:`recomputed_gemms` says what each mode recomputes. What each mode keeps and why:
docs/benchmark.md#networks-and-modes.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ._activations import QuickGELU, Sin  # noqa: F401  (the modules of sin, quick_gelu)
from ._activations import MODULE_OF, activation_backward
from ._lora import LoRA
from .modules import FusedGatedMLP, FusedLinearTanh, FusedMLP, FusedTanhMLP
from .ops import gated_mlp, moe_experts, tanh_mlp

#: Every mode some network has; each class lists its own in ``MODES``.
ALL_MODES = ("plain", "checkpoint", "checkpoint-stack", "fused", "liger", "unsloth",
             "checkpoint-fused")


#: The stock module of each activation name of ``ckpt_ext.mlp``: what the plain and checkpoint
#: modes run where ``fused`` passes the name.
ACTIVATION_MODULES = MODULE_OF


def _check_args(cls, mode: str, use_reentrant: bool) -> None:
    if mode not in cls.MODES:
        raise ValueError(f"{cls.__name__}: mode must be one of {', '.join(cls.MODES)}, "
                         f"got {mode!r}")
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be a bool, got {type(use_reentrant).__name__}")


def _linear_tanh(features: int, device, dtype) -> nn.Sequential:
    return nn.Sequential(nn.Linear(features, features, device=device, dtype=dtype), nn.Tanh())


class _Recompute:
    """The checkpoint call every network shares. ``use_reentrant`` is always passed: torch warns
    when it is left out, and the two variants keep different things (reentrant re-runs under its
    own autograd graph)."""
    mode: str
    use_reentrant: bool

    def _checkpoint(self, fn, h: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            return checkpoint(fn, h, use_reentrant=self.use_reentrant)
        return fn(h)  # no graph, nothing to save

    @staticmethod
    def loss(out: Tensor, x: Tensor) -> Tensor:
        """The write-up's loss, ``output.mean()``."""
        return out.mean()


class Net(_Recompute, nn.Module):
    """The write-up's chain ``linear1 -> block1 -> block2 -> block3`` (``depth`` blocks).

    ``mode="checkpoint"`` checkpoints block1 .. block{depth-1} (not the last block, as in the
    write-up); ``"checkpoint-stack"`` checkpoints block1 .. block{depth} as one call; ``"fused"``
    runs block1 .. block{depth} as one :func:`ckpt_ext.tanh_mlp` over the blocks' own Linear
    parameters (the blocks stay ``Sequential(Linear, Tanh)``, so the keys are plain's).
    ``use_reentrant`` picks the variant of ``torch.utils.checkpoint``.
    """

    MODES = ("plain", "checkpoint", "checkpoint-stack", "fused")

    def __init__(self, in_features: int = 1024, hidden: int = 10240, depth: int = 3,
                 mode: str = "plain", use_reentrant: bool = False, device=None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        _check_args(type(self), mode, use_reentrant)
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.mode, self.use_reentrant, self.depth = mode, use_reentrant, depth
        self.linear1 = nn.Linear(in_features, hidden, device=device, dtype=dtype)
        for i in range(1, depth + 1):
            setattr(self, f"block{i}", _linear_tanh(hidden, device, dtype))

    def blocks(self) -> list[nn.Module]:
        return [getattr(self, f"block{i}") for i in range(1, self.depth + 1)]

    def _stack(self, h: Tensor) -> Tensor:
        for block in self.blocks():
            h = block(h)
        return h

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear1(x)
        if self.mode == "fused":
            linears = [block[0] for block in self.blocks()]
            return tanh_mlp(h, [lin.weight for lin in linears], [lin.bias for lin in linears])
        if self.mode == "checkpoint-stack":
            return self._checkpoint(self._stack, h)
        for i, block in enumerate(self.blocks(), start=1):
            h = self._checkpoint(block, h) if self.mode == "checkpoint" and i < self.depth \
                else block(h)
        return h


class _ResidualStack(_Recompute, nn.Module):
    """``h = linear1(x)``, then per block ``h = h + block(h)``; every block is recomputed in
    ``checkpoint`` mode. Subclasses say what a block is in each mode."""

    MODES = ("plain", "checkpoint", "fused")

    def __init__(self, in_features: int, hidden: int, depth: int, mode: str, use_reentrant: bool,
                 make_block, device=None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        _check_args(type(self), mode, use_reentrant)
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.mode, self.use_reentrant = mode, use_reentrant
        # linear1 first, then the blocks: the order the parameters draw from the RNG
        self.linear1 = nn.Linear(in_features, hidden, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(make_block() for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear1(x)
        for block in self.blocks:
            h = h + (self._checkpoint(block, h) if self.mode == "checkpoint" else block(h))
        return h


class ResidualNet(_ResidualStack):
    """``h = linear1(x)``, then per block ``h = h + tanh(Linear(h))``; every block is
    checkpointed in ``checkpoint`` mode and is a :class:`~ckpt_ext.FusedLinearTanh` in ``fused``
    mode (kept in a ``Sequential`` with an ``Identity``, so the keys are ``blocks.0.0.weight`` as
    in plain)."""

    def __init__(self, in_features: int = 1024, hidden: int = 10240, depth: int = 3,
                 mode: str = "plain", use_reentrant: bool = False, device=None,
                 dtype: Optional[torch.dtype] = None) -> None:
        def block():
            if mode == "fused":
                return nn.Sequential(FusedLinearTanh(hidden, hidden, device=device, dtype=dtype),
                                     nn.Identity())
            return _linear_tanh(hidden, device, dtype)

        super().__init__(in_features, hidden, depth, mode, use_reentrant, block, device, dtype)


class MLPBlock(nn.Module):
    """``fc2(tanh(fc1(h)))`` with fc1: H -> ratio*H, fc2: ratio*H -> H (the residual add is in
    :class:`MLPNet`), in plain PyTorch."""

    def __init__(self, hidden: int, ratio: int, device=None, dtype=None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ratio * hidden, device=device, dtype=dtype)
        self.fc2 = nn.Linear(ratio * hidden, hidden, device=device, dtype=dtype)

    def forward(self, h: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(h)))


def fused_mlp_block(hidden: int, ratio: int, device=None, dtype=None) -> FusedTanhMLP:
    """:class:`MLPBlock` as one :class:`~ckpt_ext.FusedTanhMLP` ``[H, ratio*H, H]`` without a final
    tanh: it keeps only ``h`` and recomputes fc1 once in backward. Its Linears are registered
    under ``fc1``/``fc2``, so its keys are MLPBlock's, and drawn in the same order (same values
    from the same seed)."""
    fc1 = nn.Linear(hidden, ratio * hidden, device=device, dtype=dtype)
    fc2 = nn.Linear(ratio * hidden, hidden, device=device, dtype=dtype)
    return FusedTanhMLP.from_modules({"fc1": fc1, "act": nn.Tanh(), "fc2": fc2})


class MLPNet(_ResidualStack):
    """``h = linear1(x)``, then per block ``h = h + MLPBlock(h)``; every block is checkpointed in
    ``checkpoint`` mode and is :func:`fused_mlp_block` in ``fused`` mode."""

    def __init__(self, in_features: int = 1024, hidden: int = 10240, depth: int = 3,
                 mode: str = "plain", use_reentrant: bool = False, ratio: int = 4, device=None,
                 dtype: Optional[torch.dtype] = None) -> None:
        def block():
            if mode == "fused":
                return fused_mlp_block(hidden, ratio, device, dtype)
            return MLPBlock(hidden, ratio, device, dtype)

        super().__init__(in_features, hidden, depth, mode, use_reentrant, block, device, dtype)


class BertMLPBlock(nn.Module):
    """BERT's feed-forward sublayer (``BertIntermediate`` + ``BertOutput``, without dropout):
    ``norm(h + mlp(h))`` with ``mlp = Linear(W, H), GELU(), Linear(H, W)`` (exact GELU) or, when
    ``fused``, :class:`~ckpt_ext.FusedMLP` ``[W, H, W]`` with ``activation="gelu"`` and no final
    activation (the same keys ``mlp.0``/``mlp.2``, the same values from the same seed), and
    ``norm = LayerNorm(W, eps=1e-12)``. ``forward(h, recompute)`` runs ``mlp`` through
    ``recompute(mlp, h)`` where given (a checkpoint call)."""

    def __init__(self, width: int, hidden: int, fused: bool, device=None, dtype=None) -> None:
        super().__init__()
        if fused:
            self.mlp = FusedMLP([width, hidden, width], activation="gelu",
                                last_activation=False, device=device, dtype=dtype)
        else:
            self.mlp = nn.Sequential(nn.Linear(width, hidden, device=device, dtype=dtype),
                                     nn.GELU(),
                                     nn.Linear(hidden, width, device=device, dtype=dtype))
        self.norm = nn.LayerNorm(width, eps=1e-12, device=device, dtype=dtype)

    def forward(self, h: Tensor, recompute: Optional[Callable] = None) -> Tensor:
        return self.norm(h + (self.mlp(h) if recompute is None else recompute(self.mlp, h)))


class BertMLPNet(_Recompute, nn.Module):
    """``depth`` :class:`BertMLPBlock` in a row, width ``in_features`` (W, 768 in BERT-base) and
    MLP width ``hidden`` (H, 3072), on rows of tokens ``(..., W)``. ``checkpoint`` checkpoints
    each block's MLP (the residual add and the LayerNorm stay outside, where a transformer has
    them); ``fused`` makes each MLP one FusedMLP, which keeps only the block's input. Not
    reentrant checkpoint: it would leave the first block without gradients.

    The loss is ``(out * x).mean()``, the input serving as a fixed readout direction:
    ``out.mean()`` would be constant, a LayerNorm's output having mean ``mean(bias)`` for every
    input while its weight is all ones."""

    MODES = ("plain", "checkpoint", "fused")

    def __init__(self, in_features: int = 768, hidden: int = 3072, depth: int = 3,
                 mode: str = "plain", use_reentrant: bool = False, device=None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        _check_args(type(self), mode, use_reentrant)
        if use_reentrant:
            raise ValueError("BertMLPNet: use_reentrant=True would give the first block no "
                             "gradients (reentrant checkpoint differentiates only through inputs "
                             "that require grad, and the token rows do not)")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.mode, self.use_reentrant = mode, use_reentrant
        self.blocks = nn.ModuleList(BertMLPBlock(in_features, hidden, mode == "fused", device,
                                                 dtype) for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for block in self.blocks:
            h = block(h, self._checkpoint if self.mode == "checkpoint" else None)
        return h

    @staticmethod
    def loss(out: Tensor, x: Tensor) -> Tensor:
        """``(out * x).mean()``: its backward saves ``x`` (alive anyway), not ``out``."""
        return (out * x).mean()


class _SiLUMul(torch.autograd.Function):
    """silu(g) * u keeping g and u and recomputing the product's factors in backward: what
    Liger-Kernel's LigerSiLUMulFunction keeps, written in plain torch."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor) -> Tensor:
        ctx.save_for_backward(g, u)
        return torch.nn.functional.silu(g) * u

    @staticmethod
    def backward(ctx, gh: Tensor):
        g, u = ctx.saved_tensors
        return activation_backward("silu", gh * u, g), gh * torch.nn.functional.silu(g)


class GatedMLP(nn.Module):
    """transformers' ``LlamaMLP``: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases.
    ``liger``: the product through :class:`_SiLUMul` (gate and up kept, the product recomputed),
    as Liger-Kernel's ``LigerSwiGLUMLP`` computes it."""

    def __init__(self, hidden: int, inter: int, liger: bool = False, device=None,
                 dtype=None) -> None:
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden, inter, **kw)
        self.up_proj = nn.Linear(hidden, inter, **kw)
        self.down_proj = nn.Linear(inter, hidden, **kw)
        self.act_fn = nn.SiLU()
        self.liger = liger

    def forward(self, x: Tensor) -> Tensor:
        if self.liger:
            return self.down_proj(_SiLUMul.apply(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaMLPBlock(nn.Module):
    """A Llama decoder layer's MLP sublayer: ``h + mlp(norm(h))`` with ``norm = nn.RMSNorm(W,
    eps=1e-6)`` and ``mlp`` :class:`GatedMLP` (W -> I -> W, SiLU), or :class:`~ckpt_ext.FusedGatedMLP`
    when ``fused`` (the same keys and seeded values), or the ``mlp`` given.
    ``forward(h, recompute)`` runs ``mlp`` through ``recompute(mlp, n)`` where given (a
    checkpoint call)."""

    def __init__(self, width: int, inter: int, mode: str, device=None, dtype=None,
                 mlp: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(width, eps=1e-6, device=device, dtype=dtype)
        if mlp is not None:
            self.mlp = mlp
        elif mode == "fused":
            self.mlp = FusedGatedMLP(width, inter, "silu", device=device, dtype=dtype)
        else:
            self.mlp = GatedMLP(width, inter, mode == "liger", device=device, dtype=dtype)

    def forward(self, h: Tensor, recompute: Optional[Callable] = None) -> Tensor:
        n = self.norm(h)
        return h + (self.mlp(n) if recompute is None else recompute(self.mlp, n))


class LlamaMLPNet(_Recompute, nn.Module):
    """``depth`` :class:`LlamaMLPBlock` in a row, width ``in_features`` (the hidden size) and
    intermediate width ``hidden``, on rows of tokens ``(..., W)``. ``checkpoint`` checkpoints each
    block's MLP (the norm and the residual add stay outside, where a transformer has them);
    ``fused`` makes each MLP one :class:`~ckpt_ext.FusedGatedMLP`, which keeps only its input;
    ``liger`` keeps what Liger-Kernel keeps (the MLP's input, gate, up and the product the down
    projection reads). The loss is ``output.mean()``."""

    MODES = ("plain", "checkpoint", "fused", "liger")

    def __init__(self, in_features: int = 1024, hidden: int = 2816, depth: int = 3,
                 mode: str = "plain", use_reentrant: bool = False, device=None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        _check_args(type(self), mode, use_reentrant)
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.mode, self.use_reentrant = mode, use_reentrant
        self.blocks = nn.ModuleList(LlamaMLPBlock(in_features, hidden, mode, device, dtype)
                                    for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for block in self.blocks:
            h = block(h, self._checkpoint if self.mode == "checkpoint" else None)
        return h


# ---- LoRA adapters on a Llama MLP ----------------------------------------------------------------

class LoRALinear(nn.Module):
    """peft's vanilla ``lora.Linear`` with one adapter on a frozen bias-free ``nn.Linear``:
    ``base_layer(x) + lora_B(lora_A(lora_dropout(x))) * scaling``, op for op, with ``lora_A =
    Linear(in, r)`` and ``lora_B = Linear(r, out)`` (no biases), ``scaling = alpha / r`` and
    ``lora_dropout`` an ``nn.Dropout(p)`` (``nn.Identity`` for p = 0), as peft names them. Both LoRA
    weights get ``nn.Linear``'s initialisation: peft's zero B would give A no gradient."""

    def __init__(self, in_features: int, out_features: int, r: int, alpha: float, dropout: float,
                 device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.base_layer = nn.Linear(in_features, out_features, **kw).requires_grad_(False)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(in_features, r, **kw)
        self.lora_B = nn.Linear(r, out_features, **kw)
        self.scaling = alpha / r

    def forward(self, x: Tensor) -> Tensor:
        result = self.base_layer(x)
        return result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def term(self) -> LoRA:
        """The adapter as the ops take it: its dropout's p while it trains, else 0."""
        drop = self.lora_dropout
        p = drop.p if isinstance(drop, nn.Dropout) and drop.training else 0.0
        return LoRA(self.lora_A.weight, self.lora_B.weight, self.scaling, None, p)


def _lora_linear(x: Tensor, w: Tensor, a: Tensor, b: Tensor, s: float) -> Tensor:
    """:class:`LoRALinear`'s forward at dropout 0, op for op."""
    return F.linear(x, w) + F.linear(F.linear(x, a), b) * s


class _UnslothLoRAMLP(torch.autograd.Function):
    """``down(silu(gate(x)) * up(x))``, each a :class:`LoRALinear` at dropout 0, keeping what
    Unsloth's ``LoRA_MLP`` keeps: x, the gate's output e and the up projection's u (not silu(e),
    not the product h), written in plain torch (Unsloth's Triton kernels need a GPU). Backward
    recomputes no base GEMM: h and the two gradients from e and u in their own buffers and one
    more (Unsloth's kernel needs none more), and the LoRA A projections of x and h, as Unsloth's.

    apply(x, W_gate, A_gate, B_gate, W_up, A_up, B_up, W_down, A_down, B_down, s_gate, s_up,
    s_down)."""

    @staticmethod
    def forward(ctx, x, wg, ag, bg, wu, au, bu, wd, ad, bd, sg, su, sd):
        e = _lora_linear(x, wg, ag, bg, sg)
        u = _lora_linear(x, wu, au, bu, su)
        y = _lora_linear(F.silu(e) * u, wd, ad, bd, sd)
        ctx.save_for_backward(x, e, u, wg, ag, bg, wu, au, bu, wd, ad, bd)
        ctx.scalings = (sg, su, sd)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, e, u, wg, ag, bg, wu, au, bu, wd, ad, bd = ctx.saved_tensors
        sg, su, sd = ctx.scalings
        need = ctx.needs_input_grad
        x2, e2, u2, gy2 = (t.reshape(-1, t.shape[-1]) for t in (x, e, u, gy))
        gt_d = (gy2 @ bd).mul_(sd)  # the gradient at down's lora_A output
        gh = gy2 @ wd
        gh.addmm_(gt_d, ad)
        # e and u are written over (a second backward through this graph fails on their versions)
        sig = torch.sigmoid(e2)
        f = e2.mul_(sig)  # e's buffer: silu(e)
        de = sig.addcmul_(f, sig, value=-1).add_(f).mul_(u2).mul_(gh)  # silu'(e) = σ + f·(1 − σ)
        h = u2.mul_(f)  # u's buffer: h
        du = f.mul_(gh)  # e's buffer: the gradient at u
        del gh
        grads, gx = [None] * 13, None
        for i, (dz, a, w, la, lb, s) in enumerate(((gy2, h, wd, ad, bd, sd),
                                                   (du, x2, wu, au, bu, su),
                                                   (de, x2, wg, ag, bg, sg))):
            k = (7, 4, 1)[i]  # W's position among the inputs; A and B follow it
            gt = gt_d if i == 0 else (dz @ lb).mul_(s)
            if need[k]:
                grads[k] = dz.t() @ a
            if need[k + 1]:
                grads[k + 1] = gt.t() @ a
            if need[k + 2]:
                grads[k + 2] = (dz.t() @ (a @ la.t())).mul_(s)
            if i > 0 and need[0]:
                gx = dz @ w if gx is None else gx.addmm_(dz, w)
                gx.addmm_(gt, la)
        if need[0]:
            grads[0] = gx.view(x.shape)
        return tuple(grads)


class LoRAGatedMLP(nn.Module):
    """transformers' ``LlamaMLP`` with a :class:`LoRALinear` for each of gate_proj, up_proj and
    down_proj (peft's ``target_modules`` naming the three). ``kernel`` says how it runs: "plain"
    (peft's forward), "fused" (one :func:`ckpt_ext.gated_mlp` with the three LoRA terms: it keeps
    x only, and with dropout it draws the masks as peft does and again in backward), "liger"
    (peft's projections around :class:`_SiLUMul`: Liger-Kernel's policy, gate and up kept) or
    "unsloth" (:class:`_UnslothLoRAMLP`, dropout 0 only)."""

    def __init__(self, hidden: int, inter: int, r: int, alpha: float, dropout: float,
                 kernel: str = "plain", device=None, dtype=None) -> None:
        super().__init__()
        if kernel == "unsloth" and dropout > 0:
            raise ValueError(f"LoRAGatedMLP: the unsloth kernel runs only at lora_dropout 0 "
                             f"(Unsloth falls back to peft's forward otherwise), got {dropout}")
        lora = dict(r=r, alpha=alpha, dropout=dropout, device=device, dtype=dtype)
        self.gate_proj = LoRALinear(hidden, inter, **lora)
        self.up_proj = LoRALinear(hidden, inter, **lora)
        self.down_proj = LoRALinear(inter, hidden, **lora)
        self.act_fn = nn.SiLU()
        self.kernel = kernel

    def forward(self, x: Tensor) -> Tensor:
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        if self.kernel == "fused":
            return gated_mlp(x, *(p.base_layer.weight for p in projs), activation="silu",
                             lora=[p.term() for p in projs])
        if self.kernel == "unsloth":
            return _UnslothLoRAMLP.apply(
                x, *(t for p in projs for t in (p.base_layer.weight, p.lora_A.weight,
                                                 p.lora_B.weight)), *(p.scaling for p in projs))
        if self.kernel == "liger":
            return self.down_proj(_SiLUMul.apply(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaLoRANet(_Recompute, nn.Module):
    """:class:`LlamaMLPNet`'s blocks (``h + mlp(norm(h))``, ``norm = nn.RMSNorm(W, eps=1e-6)``)
    fine-tuned with LoRA: every base weight frozen (the norms' too), each MLP a
    :class:`LoRAGatedMLP` with rank :attr:`RANK` (16), alpha :attr:`ALPHA` (32: scaling 2) and
    lora_dropout ``lora_dropout`` (default :attr:`DROPOUT`). Modes: ``checkpoint`` checkpoints each
    block's MLP; ``fused`` runs each MLP as one :func:`ckpt_ext.gated_mlp`; ``liger`` keeps what
    Liger-Kernel's SiLU-mul keeps (gate and up) around peft's projections; ``unsloth`` keeps what
    Unsloth keeps (dropout 0 only); ``checkpoint-fused`` checkpoints each fused MLP (the gate and
    up projections then run three times). The loss is ``output.mean()``."""

    MODES = ("plain", "checkpoint", "fused", "liger", "unsloth", "checkpoint-fused")
    RANK = 16
    ALPHA = 32
    DROPOUT = 0.0

    def __init__(self, in_features: int = 1024, hidden: int = 2816, depth: int = 3,
                 mode: str = "plain", use_reentrant: bool = False, device=None,
                 dtype: Optional[torch.dtype] = None, lora_dropout: Optional[float] = None) -> None:
        super().__init__()
        _check_args(type(self), mode, use_reentrant)
        if use_reentrant:
            raise ValueError(f"{type(self).__name__}: use_reentrant=True would give the first "
                             f"block no gradients (reentrant checkpoint differentiates only "
                             f"through inputs that require grad, and the frozen norm's output "
                             f"of the token rows does not)")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        p = self.DROPOUT if lora_dropout is None else float(lora_dropout)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{type(self).__name__}: lora_dropout must be in [0, 1), got {p}")
        self.mode, self.use_reentrant, self.lora_dropout = mode, use_reentrant, p
        kernel = {"fused": "fused", "checkpoint-fused": "fused", "unsloth": "unsloth",
                  "liger": "liger"}.get(mode, "plain")
        self.blocks = nn.ModuleList(
            LlamaMLPBlock(in_features, inter=hidden, mode=mode, device=device, dtype=dtype,
                          mlp=LoRAGatedMLP(in_features, hidden, self.RANK, self.ALPHA, p, kernel,
                                           device, dtype))
            for _ in range(depth))
        for block in self.blocks:
            block.norm.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        h = x
        recompute = self._checkpoint if self.mode in ("checkpoint", "checkpoint-fused") else None
        for block in self.blocks:
            h = block(h, recompute)
        return h

    @classmethod
    def recomputed_gemms(cls, mode: str, tokens: int, width: int, inter: int, depth: int) -> list:
        """:func:`recomputed_gemms` of this network (lora_dropout :attr:`DROPOUT`): each
        projection is its base GEMM and the two of its LoRA term. Checkpoint re-runs the MLP up
        to down's lora_B, whose saved input is the last tensor backward needs (peft runs the base
        GEMM first); the fused op at dropout 0 recomputes gate and up with their LoRA terms and
        down's ``h·A_downᵀ``, and with dropout, the whole MLP (it draws the masks again), as does
        the checkpoint's re-run of a fused MLP; Unsloth's policy recomputes the LoRA A
        projections only, Liger's none."""
        M, W, I, r = tokens, width, inter, cls.RANK
        up = [(M, W, I), (M, W, r), (M, r, I)]
        mlp = up + up + [(M, I, W), (M, I, r), (M, r, W)]
        fused = mlp if cls.DROPOUT > 0 else up + up + [(M, I, r)]
        per_block = {"plain": [], "liger": [], "checkpoint": mlp[:-1], "fused": fused,
                     "unsloth": [(M, W, r), (M, W, r), (M, I, r)],
                     "checkpoint-fused": mlp + fused}[mode]
        return per_block * depth


class LlamaLoRADropoutNet(LlamaLoRANet):
    """:class:`LlamaLoRANet` with lora_dropout 0.05 when none is given (network
    ``llama-lora-dropout``); no ``unsloth`` mode (Unsloth runs peft's forward at dropout > 0)."""
    MODES = tuple(m for m in LlamaLoRANet.MODES if m != "unsloth")
    DROPOUT = 0.05


# ---- a mixture of experts ------------------------------------------------------------------------

def experts_implementation(dtype: Optional[torch.dtype], hidden: int, inter: int) -> str:
    """transformers' experts implementation :class:`MoENet` runs in plain mode: ``grouped_mm``
    (torch's grouped GEMM) where torch's takes the dtype and widths, else ``eager`` (transformers'
    loop over experts): torch's CPU grouped_mm takes no float64 and rows of a multiple of 16
    bytes only."""
    dtype = dtype or torch.get_default_dtype()
    size = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.float64 or (hidden * size) % 16 or (inter * size) % 16:
        return "eager"
    return "grouped_mm"


class SparseMoE(nn.Module):
    """Mixtral's sparse MoE block on rows of tokens, built from transformers' own modules: the
    router ``gate`` (``MixtralTopKRouter``: softmax in float32 over the experts, top-k,
    renormalised) and ``experts`` (``MixtralExperts``, weights (E, 2·inter, hidden) and (E, hidden,
    inter), SiLU), in transformers' experts implementation ``implementation``; ``fused``: the
    experts through :func:`ckpt_ext.moe_experts` over their own parameters (it keeps x and the
    routing only). Parameters drawn as ``nn.Linear``'s (uniform within 1/√fan_in)."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, fused: bool,
                 implementation: str, device=None, dtype=None) -> None:
        super().__init__()
        try:
            from transformers import MixtralConfig
            from transformers.models.mixtral.modeling_mixtral import (MixtralExperts,
                                                                      MixtralTopKRouter)
        except ImportError as e:
            raise ImportError(f"SparseMoE builds transformers' Mixtral router and experts; "
                              f"transformers is not importable here ({e})") from e
        config = MixtralConfig(hidden_size=hidden, intermediate_size=inter,
                               num_local_experts=experts, num_experts_per_tok=top_k,
                               hidden_act="silu")
        config._experts_implementation = implementation
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.gate = MixtralTopKRouter(config)
            self.experts = MixtralExperts(config)
        self.to(dtype=dtype or torch.get_default_dtype())
        with torch.no_grad():
            for p, fan_in in ((self.gate.weight, hidden), (self.experts.gate_up_proj, hidden),
                              (self.experts.down_proj, inter)):
                p.uniform_(-fan_in ** -0.5, fan_in ** -0.5)
        self.fused = fused

    def forward(self, n: Tensor) -> Tensor:
        rows = n.reshape(-1, n.shape[-1])
        _, top_k_weights, top_k_index = self.gate(rows)
        if self.fused:
            y = moe_experts(rows, top_k_index, top_k_weights, self.experts.gate_up_proj,
                            self.experts.down_proj, activation="silu")
        else:
            y = self.experts(rows, top_k_index, top_k_weights)
        return y.reshape(n.shape)


class MoENet(_Recompute, nn.Module):
    """A Mixtral decoder layer's MoE sublayer, ``depth`` times: ``h + moe(norm(h))`` with
    ``norm = nn.RMSNorm(W, eps=1e-6)`` and ``moe`` a :class:`SparseMoE` of :attr:`EXPERTS` (8)
    experts, top :attr:`TOP_K` (2), hidden size ``in_features`` and expert intermediate size
    ``hidden``, on rows of tokens ``(..., W)``. Needs transformers. Plain runs transformers'
    ``grouped_mm`` experts implementation (:func:`experts_implementation` says where it cannot);
    ``checkpoint`` checkpoints each MoE block (router and experts; the norm and the add stay
    outside); ``fused`` runs the experts through :func:`ckpt_ext.moe_experts`. The loss is
    ``output.mean()``."""

    MODES = ("plain", "checkpoint", "fused")
    EXPERTS = 8
    TOP_K = 2
    #: the packages it builds on beyond the package's own dependencies
    REQUIRES = ("transformers",)

    def __init__(self, in_features: int = 1024, hidden: int = 1024, depth: int = 3,
                 mode: str = "plain", use_reentrant: bool = False, device=None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        _check_args(type(self), mode, use_reentrant)
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.mode, self.use_reentrant = mode, use_reentrant
        self.experts_implementation = experts_implementation(dtype, in_features, hidden)
        self.blocks = nn.ModuleList(
            LlamaMLPBlock(in_features, inter=hidden, mode=mode, device=device, dtype=dtype,
                          mlp=SparseMoE(in_features, hidden, self.EXPERTS, self.TOP_K,
                                        mode == "fused", self.experts_implementation, device,
                                        dtype))
            for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for block in self.blocks:
            h = block(h, self._checkpoint if self.mode == "checkpoint" else None)
        return h

    @classmethod
    def routing_bytes(cls, tokens: int, depth: int) -> int:
        """What the routing adds to the blocks' inputs in a mode that keeps the experts' input
        only, in bytes: per block what transformers' router keeps, its float32 probabilities
        (tokens, E), the top-k indices (int64), the top-k probabilities before and after their
        renormalisation and their sum (float32)."""
        E, k = cls.EXPERTS, cls.TOP_K
        return depth * tokens * (4 * E + 8 * k + 2 * 4 * k + 4)

    @classmethod
    def recomputed_gemms(cls, mode: str, tokens: int, width: int, inter: int, depth: int) -> list:
        """:func:`recomputed_gemms` of this network, each expert GEMM as one over every routed
        row (tokens·k of them; the same FLOPs as the experts' GEMMs over their own rows).
        Checkpoint re-runs the router and both expert GEMMs (the routing weights' product keeps
        the down projection's output); the fused op recomputes the gate and up projections."""
        rows = tokens * cls.TOP_K
        gate_up = (rows, width, 2 * inter)
        per_block = {"plain": [], "fused": [gate_up],
                     "checkpoint": [(tokens, width, cls.EXPERTS), gate_up,
                                    (rows, inter, width)]}[mode]
        return per_block * depth


class PINNNet(_Recompute, nn.Module):
    """A physics-informed network ``u(t, x)``: ``Linear(2, hidden), Act`` then ``depth - 1`` times
    ``Linear(hidden, hidden), Act``, then ``Linear(hidden, 1)``, held as ``self.mlp`` (keys
    ``mlp.0.weight`` ... in every mode), ``Act`` being ``activation``'s module in
    :data:`ACTIVATION_MODULES` (default :attr:`ACTIVATION`, tanh). ``fused`` makes it one
    :class:`~ckpt_ext.FusedTanhMLP` for tanh (``from_modules`` of the Sequential: the same Linear
    modules), else one :class:`~ckpt_ext.FusedMLP` with ``activation`` (the same keys and seeded
    values); ``checkpoint`` checkpoints the MLP as one call. The training step is :meth:`loss` of
    the output and the points."""

    MODES = ("plain", "checkpoint", "fused")

    #: heat equation u_t = KAPPA * u_xx
    KAPPA = 0.1
    #: the activation when none is given
    ACTIVATION = "tanh"

    def __init__(self, in_features: int = 2, hidden: int = 64, depth: int = 4,
                 mode: str = "plain", use_reentrant: bool = False, out_features: int = 1,
                 device=None, dtype: Optional[torch.dtype] = None,
                 activation: Optional[str] = None) -> None:
        super().__init__()
        _check_args(type(self), mode, use_reentrant)
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if in_features != 2:
            raise ValueError(f"PINNNet: in_features must be 2 (the points are (t, x)), "
                             f"got {in_features}")
        activation = self.ACTIVATION if activation is None else activation
        if activation not in ACTIVATION_MODULES:
            raise ValueError(f"PINNNet: activation must be one of "
                             f"{', '.join(ACTIVATION_MODULES)}, got {activation!r}")
        self.mode, self.use_reentrant, self.activation = mode, use_reentrant, activation
        sizes = [in_features] + [hidden] * depth + [out_features]
        if mode == "fused" and activation != "tanh":
            self.mlp = FusedMLP(sizes, activation=activation, last_activation=False,
                                device=device, dtype=dtype)
            return
        layers: list[nn.Module] = []
        for k, n in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(k, n, device=device, dtype=dtype),
                       ACTIVATION_MODULES[activation]()]
        seq = nn.Sequential(*layers[:-1])  # no activation after the output layer
        self.mlp = FusedTanhMLP.from_modules(seq) if mode == "fused" else seq

    def forward(self, points: Tensor) -> Tensor:
        if self.mode == "checkpoint":
            return self._checkpoint(self.mlp, points)
        return self.mlp(points)

    @staticmethod
    def points(n: int, generator: Optional[torch.Generator] = None, device=None,
               dtype: Optional[torch.dtype] = None) -> Tensor:
        """``n`` points (t, x) in [0, 1]^2 that require grad: the first ``n // 8`` on the boundary
        x in {0, 1}, the next ``n // 8`` at t = 0, the rest inside (the layout :meth:`loss`
        reads)."""
        p = torch.rand(n, 2, generator=generator, dtype=torch.float64)
        nb = n // 8
        p[:nb, 1] = (torch.arange(nb) % 2).double()
        p[nb:2 * nb, 0] = 0.0
        return p.to(device=device, dtype=dtype or torch.get_default_dtype()).requires_grad_()

    @staticmethod
    def loss(u: Tensor, points: Tensor) -> Tensor:
        """Heat-equation residual ``u_t - KAPPA * u_xx`` at every point, plus ``u = 0`` on the
        boundary and ``u = sin(pi x)`` at t = 0. ``u_t``, ``u_x`` and ``u_xx`` come from
        ``torch.autograd.grad(create_graph=True)`` twice, so the parameter backward that follows
        differentiates the first-order backward (a double backward)."""
        (du,) = torch.autograd.grad(u.sum(), points, create_graph=True)
        u_t, u_x = du[:, 0], du[:, 1]
        (du_x,) = torch.autograd.grad(u_x.sum(), points, create_graph=True)
        u_xx = du_x[:, 1]
        nb = points.shape[0] // 8
        u = u[:, 0]
        residual = ((u_t - PINNNet.KAPPA * u_xx) ** 2).mean()
        boundary = (u[:nb] ** 2).mean() if nb else u.new_zeros(())
        u0 = torch.sin(math.pi * points[nb:2 * nb, 1].detach())
        initial = ((u[nb:2 * nb] - u0) ** 2).mean() if nb else u.new_zeros(())
        return residual + boundary + initial


class SinPINNNet(PINNNet):
    """:class:`PINNNet` with sin activations when none is given (network ``pinn-sin``)."""
    ACTIVATION = "sin"


class SiLUPINNNet(PINNNet):
    """:class:`PINNNet` with SiLU activations when none is given (network ``pinn-silu``)."""
    ACTIVATION = "silu"


#: The benchmark's networks by name; each takes ``(in_features, hidden, depth, mode,
#: use_reentrant, device, dtype)`` and has ``MODES`` and ``loss(out, x)``.
NETWORKS = {"chain": Net, "residual": ResidualNet, "mlp": MLPNet, "bert-mlp": BertMLPNet,
            "llama-mlp": LlamaMLPNet, "llama-lora": LlamaLoRANet,
            "llama-lora-dropout": LlamaLoRADropoutNet, "moe": MoENet, "pinn": PINNNet,
            "pinn-sin": SinPINNNet, "pinn-silu": SiLUPINNNet}


def is_pinn(name: str) -> bool:
    """Whether network ``name`` is physics-informed: it takes (t, x) points, and its loss needs a
    double backward."""
    return issubclass(NETWORKS[name], PINNNet)


def recomputed_gemms(name: str, mode: str, batch: int, in_features: int, hidden: int, depth: int,
                     ratio: int = 4, use_reentrant: bool = False
                     ) -> Optional[Sequence[tuple[int, int, int]]]:
    """The forward GEMMs, as (M, K, N) for ``x (M, K) @ W.T (K, N)``, that ``mode`` of network
    ``name`` runs again in backward (None where that is not a fixed list: the physics-informed
    networks, whose double backward recomputes through autograd). The benchmark times them alone
    for its "floor" column; tests/bench/test_models.py checks them against FLOP counts."""
    if is_pinn(name):
        return None
    cls = NETWORKS[name]
    if mode not in cls.MODES:
        raise ValueError(f"{cls.__name__} has no mode {mode!r}")
    if hasattr(cls, "recomputed_gemms"):
        return cls.recomputed_gemms(mode, batch, in_features, hidden, depth)
    # An MLP block's two Linears (bert-mlp, llama-mlp: in_features -> hidden -> in_features)
    width, inner = ((in_features, hidden) if name in ("bert-mlp", "llama-mlp")
                    else (hidden, ratio * hidden))
    fc1, fc2 = (batch, width, inner), (batch, inner, width)
    # Per block: what the block's backward needs recomputed. An MLP block needs act(fc1(h)) only:
    # fc2's output feeds no gradient, so neither the stack op nor non-reentrant checkpoint (which
    # stops its re-run once it has every tensor backward asked for) runs fc2 again; reentrant
    # checkpoint re-runs the whole MLP.
    per_block = {"chain": [(batch, hidden, hidden)], "residual": [(batch, hidden, hidden)],
                 "mlp": [fc1] + ([fc2] if use_reentrant else []), "bert-mlp": [fc1],
                 # gate and up (checkpoint's re-run stops before down, whose output no gradient
                 # needs); liger recomputes no GEMM
                 "llama-mlp": [fc1, fc1] if mode != "liger" else []}[name]
    if mode == "plain":
        return []
    if mode == "checkpoint" and name == "chain":
        return per_block * (depth - 1)  # the write-up's placement leaves the last block alone
    return per_block * depth  # checkpoint (every block), checkpoint-stack and fused
