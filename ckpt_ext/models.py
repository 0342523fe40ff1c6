"""The write-up's network and more, each in the modes a user would pick between (``plain``,
``checkpoint``, ``checkpoint-stack``, ``fused``): :class:`Net` (the write-up's chain: ``linear1``,
then ``block1..blockN = Sequential(Linear(H, H), Tanh())``, loss ``output.mean()``),
:class:`ResidualNet` (``h + tanh(Linear(h))``), :class:`MLPNet` (``h + Linear(4H, H)(tanh(Linear(H,
4H)(h)))``), :class:`BertMLPNet` (BERT's ``LayerNorm(h + Linear(H, W)(gelu(Linear(W, H)(h))))``),
:class:`LlamaMLPNet` (Llama's ``h + down(silu(gate(n)) * up(n))``, ``n = RMSNorm(h)``)
and :class:`PINNNet` (``2 -> H x D -> 1`` with any activation, a heat-equation loss needing
``u_xx``: a double backward). Every mode shares ``nn.Linear``'s initialisation and ``state_dict``
keys, so modes load one another's weights; :func:`recomputed_gemms` says what each mode recomputes.
What each mode keeps and why: docs/benchmark.md#networks-and-modes.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ._activations import QuickGELU, Sin  # noqa: F401  (the modules of sin, quick_gelu)
from ._activations import MODULE_OF, activation_backward
from .modules import FusedGatedMLP, FusedLinearTanh, FusedMLP, FusedTanhMLP
from .ops import tanh_mlp

#: Every mode some network has; each class lists its own in ``MODES``.
ALL_MODES = ("plain", "checkpoint", "checkpoint-stack", "fused", "liger")


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
    when ``fused`` (the same keys and seeded values). ``forward(h, recompute)`` runs ``mlp``
    through ``recompute(mlp, n)`` where given (a checkpoint call)."""

    def __init__(self, width: int, inter: int, mode: str, device=None, dtype=None) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(width, eps=1e-6, device=device, dtype=dtype)
        if mode == "fused":
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
            "llama-mlp": LlamaMLPNet, "pinn": PINNNet, "pinn-sin": SinPINNNet, "pinn-silu": SiLUPINNNet}


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
    if mode not in NETWORKS[name].MODES:
        raise ValueError(f"{NETWORKS[name].__name__} has no mode {mode!r}")
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
