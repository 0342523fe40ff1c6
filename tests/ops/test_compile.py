"""torch.compile over fused modules and converted models: one graph, eager results, the fused
kernels in both compiled directions; and FlopCounterMode's count of the op.

Inductor on CPU compiles C++ and is slow on small machines, so there is one inductor test (forward
and backward of a converted model); the graph-break checks use torch._dynamo.explain and the
dynamic-shape check the aot_eager backend (same Dynamo + AOTAutograd tracing, no codegen).
"""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.utils.flop_counter import FlopCounterMode

import ckpt_ext
from ckpt_ext import FusedLinearTanh, fuse
from _ecosys import ActorCritic, BertPooler, Net, outputs_and_grads, rel_err


class NetWithPooler(nn.Module):
    """The write-up Net (Sequential pass) followed by a BERT pooler (fx pass)."""

    def __init__(self):
        super().__init__()
        self.net = Net(d_in=12, d_hidden=40)
        self.pooler = BertPooler(40)

    def forward(self, x):
        return self.pooler(self.net(x))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_converted_model_inductor_fullgraph_matches_eager_and_keeps_fused_kernels():
    torch.manual_seed(0)
    model, report = fuse(NetWithPooler(), policy="all")
    assert len(report) == 2  # the run across the blocks, the pooler's pair
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)  # raises on any graph break
    x = torch.randn(3, 5, 12)

    def step():
        return outputs_and_grads(compiled, x)

    (out_c, in_c, g_c), codes = run_and_get_code(step)
    out_e, in_e, g_e = outputs_and_grads(eager, x)
    assert rel_err(out_c[0], out_e[0]) <= 1e-5
    assert rel_err(in_c[0], in_e[0]) <= 1e-5
    assert g_c.keys() == g_e.keys() and len(g_e) == 10
    for name in g_e:
        assert rel_err(g_c[name], g_e[name]) <= 1e-5, name

    # The generated forward calls the fused forward for both units and the generated backward the
    # fused backward for both: inductor did not decompose the op back into mm + tanh, and the
    # backward computes no tanh of its own (the recompute happens inside the op).
    fwd, bwd = codes
    assert len(re.findall(r"= torch\.ops\.ckpt_ext\.mlp\.default\(", fwd)) == 2
    assert len(re.findall(r"= torch\.ops\.ckpt_ext\.mlp_backward\.default\(", bwd)) == 2
    assert re.search(r"\btanh\b", bwd.replace("'tanh'", "").replace('"tanh"', "")) is None


@pytest.mark.parametrize("make", [
    lambda: FusedLinearTanh(12, 40),
    lambda: fuse(ActorCritic(obs_dim=12))[0],
    lambda: fuse(BertPooler(12))[0],  # the pooler: Linear -> Tanh child calls
    lambda: fuse(Net(d_in=12, d_hidden=16))[0],
], ids=["module", "actor_critic", "bert_pooler", "net"])
def test_no_graph_breaks(make):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(4, 3, 12)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_dynamic_batch_no_recompile_and_same_results():
    torch.manual_seed(0)
    model, _ = fuse(Net(d_in=12, d_hidden=16))
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    torch._dynamo.utils.counters.clear()
    for batch in (3, 5, 17):
        x = torch.randn(batch, 12)
        out_c, in_c, g_c = outputs_and_grads(compiled, x)
        out_e, in_e, g_e = outputs_and_grads(model, x)
        assert rel_err(out_c[0], out_e[0]) <= 1e-6 and rel_err(in_c[0], in_e[0]) <= 1e-6
        for name in g_e:
            assert rel_err(g_c[name], g_e[name]) <= 1e-6
    # One compiled frame for all three batch sizes (the fake kernel handles symbolic shapes).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


# ------------------------------------------------------------------------------------------------
# FLOP counting


def _flops(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops(), counter.get_flop_counts()["Global"]


@pytest.mark.parametrize("x_requires_grad", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_flop_counter_counts_forward_and_recompute(x_requires_grad, bias):
    M, K, N = 3 * 7, 13, 9  # x is (3, 7, 13): the count uses all leading dims
    torch.manual_seed(0)
    fused = FusedLinearTanh(K, N, bias=bias)
    x = torch.randn(3, 7, K, requires_grad=x_requires_grad)
    gemm = 2 * M * K * N

    fwd_only, _ = _flops(lambda: fused(x))
    assert fwd_only == gemm

    total, per_op = _flops(lambda: fused(x).sum().backward())
    # backward: the recompute of x·Wᵀ, grad_W, and grad_x only when x needs it.
    bwd = gemm * (2 + int(x_requires_grad))
    assert per_op[torch.ops.ckpt_ext.mlp] == gemm
    assert per_op[torch.ops.ckpt_ext.mlp_backward] == bwd
    assert total == gemm + bwd

    # Against stock PyTorch: exactly one GEMM more (the recompute), nothing else differs.
    plain = nn.Sequential(nn.Linear(K, N, bias=bias), nn.Tanh())
    plain_total, _ = _flops(lambda: plain(x).sum().backward())
    assert total == plain_total + gemm
