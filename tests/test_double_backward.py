"""Higher-order gradients: create_graph=True through the fused op (physics-informed training
differentiates the network output w.r.t. its input, then trains on that), while a plain
first-order backward keeps the fused backward kernel.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_ext
from ckpt_ext import FusedLinearTanh, fuse
from _ecosys import Net, rel_err
from reference import linear_tanh_ref


class OpCounter(TorchDispatchMode):
    """Counts every op that reaches the kernels (below autograd)."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_shape", [(5, 7), (2, 3, 7)])
def test_gradgradcheck_float64(x_shape, bias):
    torch.manual_seed(0)
    x = torch.randn(*x_shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = (x, w, b) if bias else (x, w)
    assert torch.autograd.gradcheck(ckpt_ext.linear_tanh, inputs)
    assert torch.autograd.gradgradcheck(ckpt_ext.linear_tanh, inputs)


def test_third_order_matches_reference():
    # d³/dx³ of sum(tanh(x·w + b)) for a 1->1 layer, against stock PyTorch.
    torch.manual_seed(0)
    x = torch.randn(11, 1, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 1, dtype=torch.float64)
    b = torch.randn(1, dtype=torch.float64)

    def third(f):
        y = f(x).sum()
        (g1,) = torch.autograd.grad(y, x, create_graph=True)
        (g2,) = torch.autograd.grad(g1.sum(), x, create_graph=True)
        (g3,) = torch.autograd.grad(g2.sum(), x)
        return g3

    got = third(lambda t: ckpt_ext.linear_tanh(t, w, b))
    ref = third(lambda t: linear_tanh_ref(t, w, b))
    assert rel_err(got, ref) <= 1e-12


class PINN(nn.Module):
    """u(t, x): the usual tanh MLP of physics-informed networks."""

    def __init__(self, width=20):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width),
                                  nn.Tanh(), nn.Linear(width, width), nn.Tanh())
        self.out = nn.Linear(width, 1)

    def forward(self, tx):
        return self.out(self.body(tx))


def pinn_loss(model, tx):
    """Residual of the heat equation u_t = 0.1·u_xx at collocation points: needs du/d(t,x) with
    create_graph=True, then a second derivative, then the parameter gradient of it all."""
    tx = tx.detach().requires_grad_()
    u = model(tx)
    (du,) = torch.autograd.grad(u.sum(), tx, create_graph=True)
    u_t, u_x = du[:, 0], du[:, 1]
    (du_x,) = torch.autograd.grad(u_x.sum(), tx, create_graph=True)
    u_xx = du_x[:, 1]
    return ((u_t - 0.1 * u_xx) ** 2).mean() + (u ** 2).mean() * 1e-2


def test_physics_informed_training_step_matches_plain_model():
    torch.manual_seed(0)
    plain = PINN().double()
    fused, report = fuse(copy.deepcopy(plain))
    assert len(report) == 3
    tx = torch.rand(64, 2, dtype=torch.float64)

    opt_p = torch.optim.Adam(plain.parameters(), lr=1e-3)
    opt_f = torch.optim.Adam(fused.parameters(), lr=1e-3)
    for _ in range(3):  # a few steps, so the second one starts from trained weights
        for model, opt in ((plain, opt_p), (fused, opt_f)):
            opt.zero_grad()
            loss = pinn_loss(model, tx)
            loss.backward()
            opt.step()
        for (name, p_p), p_f in zip(plain.named_parameters(), fused.parameters()):
            assert rel_err(p_f.grad, p_p.grad) <= 1e-10, name
            assert rel_err(p_f, p_p) <= 1e-12, name


def test_first_order_backward_keeps_the_fused_kernel():
    torch.manual_seed(0)
    model, _ = fuse(Net(d_in=12, d_hidden=16))
    x = torch.randn(5, 12, requires_grad=True)
    y = model(x).sum()
    with OpCounter() as counter:
        y.backward()
    calls = counter.calls
    # 3 fused blocks: one fused backward each, no tanh and no tanh_backward outside it, and the
    # only mm calls are the 2 of the plain linear1 (grad_x, grad_W).
    assert calls.get("ckpt_ext.linear_tanh_backward") == 3
    assert "aten.tanh" not in calls and "aten.tanh_backward" not in calls
    assert "ckpt_ext.linear_tanh" not in calls
    assert calls.get("aten.mm", 0) == 2


def test_create_graph_records_the_output_based_backward():
    # With create_graph=True the first-order backward is recorded as one node per layer that keeps
    # (grad_out, x, t) — t from one recompute by a node that keeps its output — never z or g.
    torch.manual_seed(0)
    layer = FusedLinearTanh(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    y = layer(x).sum()
    with OpCounter() as counter:
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
    assert gx.requires_grad
    assert counter.calls.get("ckpt_ext.linear_tanh") == 1  # the one recompute of t
    assert counter.calls.get("ckpt_ext.linear_tanh_backward_from_output") == 1
    node = gx.grad_fn
    assert [tuple(t.shape) for t in node.saved_tensors] == [(5, 3), (5, 4), (5, 3), (3, 4)]
    t = node.saved_tensors[2]
    assert rel_err(t, torch.tanh(torch.nn.functional.linear(x, layer.weight, layer.bias))) <= 1e-6
