"""The benchmark's networks: structure, and every mode computing plain's loss and gradients."""
import pytest
import torch
from torch import nn

import ckpt_ext
from ckpt_ext.models import MLPNet, Net, NETWORKS, ResidualNet

# (mode, use_reentrant) for every way a network can run
VARIANTS = [("checkpoint", False), ("checkpoint", True), ("fused", False)]


def _step(net, x):
    net.zero_grad(set_to_none=True)
    loss = net(x).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in net.named_parameters()}


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", list(NETWORKS))
@pytest.mark.parametrize("mode,reentrant", VARIANTS)
def test_modes_match_plain_float64(name, mode, reentrant):
    # Odd sizes, float64: the modes differ only in rounding order.
    torch.manual_seed(0)
    kw = dict(in_features=7, hidden=13, depth=3, dtype=torch.float64)
    plain = NETWORKS[name](mode="plain", **kw)
    other = NETWORKS[name](mode=mode, use_reentrant=reentrant, **kw)
    other.load_state_dict(plain.state_dict())
    x = torch.randn(5, 7, dtype=torch.float64)
    loss_p, grads_p = _step(plain, x)
    loss_o, grads_o = _step(other, x)
    assert torch.isfinite(loss_o)
    assert abs(float(loss_o - loss_p)) <= 1e-14 * max(1.0, abs(float(loss_p)))
    assert grads_o.keys() == grads_p.keys()
    for n in grads_p:
        assert grads_o[n] is not None, n
        assert _rel(grads_o[n], grads_p[n]) < 1e-12, n


@pytest.mark.parametrize("name", list(NETWORKS))
def test_modes_match_plain_float32_3d_input(name):
    # (batch, seq, features) input, float32 against a float64 plain reference.
    torch.manual_seed(1)
    kw = dict(in_features=10, hidden=24, depth=2)
    ref = NETWORKS[name](mode="plain", dtype=torch.float64, **kw)
    x = torch.randn(3, 4, 10, dtype=torch.float64)
    loss_r, grads_r = _step(ref, x)
    for mode, reentrant in [("plain", False)] + VARIANTS:
        net = NETWORKS[name](mode=mode, use_reentrant=reentrant, **kw)
        net.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
        loss, grads = _step(net, x.float())
        assert abs(float(loss) - float(loss_r)) < 1e-5, mode
        for n in grads_r:
            assert _rel(grads[n].double(), grads_r[n]) < 1e-5, (mode, n)


def test_seeded_modes_have_equal_weights_and_keys():
    for name, cls in NETWORKS.items():
        sds = []
        for mode in ("plain", "checkpoint", "fused"):
            torch.manual_seed(3)
            sds.append(cls(in_features=6, hidden=8, depth=2, mode=mode).state_dict())
        for sd in sds[1:]:
            assert list(sd) == list(sds[0]), name
            for k in sd:
                assert torch.equal(sd[k], sds[0][k]), (name, k)


def test_writeup_net_structure():
    net = Net(in_features=16, hidden=32, depth=3)
    assert isinstance(net.linear1, nn.Linear)
    assert (net.linear1.in_features, net.linear1.out_features) == (16, 32)
    for i in (1, 2, 3):
        b = getattr(net, f"block{i}")
        assert isinstance(b, nn.Sequential) and len(b) == 2
        assert isinstance(b[0], nn.Linear) and (b[0].in_features, b[0].out_features) == (32, 32)
        assert isinstance(b[1], nn.Tanh)
    assert not hasattr(net, "block4")
    fused = Net(in_features=16, hidden=32, depth=3, mode="fused")
    for i in (1, 2, 3):
        assert isinstance(getattr(fused, f"block{i}")[0], ckpt_ext.FusedLinearTanh)
    assert "block1.0.weight" in fused.state_dict()


def test_writeup_checkpoint_wraps_block1_and_block2_only(monkeypatch):
    import ckpt_ext.models as models
    seen = []
    real = models.checkpoint

    def spy(fn, *args, **kwargs):
        seen.append((fn, kwargs.get("use_reentrant")))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(models, "checkpoint", spy)
    for reentrant in (False, True):
        seen.clear()
        net = Net(in_features=4, hidden=8, depth=3, mode="checkpoint", use_reentrant=reentrant)
        net(torch.randn(2, 4)).mean().backward()
        assert seen == [(net.block1, reentrant), (net.block2, reentrant)]
    # No graph, no checkpoint: under no_grad the blocks just run.
    seen.clear()
    with torch.no_grad():
        net(torch.randn(2, 4))
    assert seen == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode must be one of plain, checkpoint, fused, got 'fast'"):
        Net(4, 8, mode="fast")
    with pytest.raises(TypeError, match="use_reentrant must be a bool, got NoneType"):
        ResidualNet(4, 8, mode="checkpoint", use_reentrant=None)
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        Net(4, 8, depth=0)


def test_fused_mlp_grad_only_for_input():
    # Frozen weights: the fused MLP block still returns the input gradient (and only that).
    torch.manual_seed(2)
    kw = dict(in_features=5, hidden=6, depth=2, dtype=torch.float64)
    plain, fused = MLPNet(mode="plain", **kw), MLPNet(mode="fused", **kw)
    fused.load_state_dict(plain.state_dict())
    for net in (plain, fused):
        net.requires_grad_(False)
    x = torch.randn(3, 5, dtype=torch.float64)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    plain(xs[0]).sum().backward()
    fused(xs[1]).sum().backward()
    assert _rel(xs[1].grad, xs[0].grad) < 1e-12
    assert all(p.grad is None for p in fused.parameters())
