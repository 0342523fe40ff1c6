"""A module whose ``forward`` someone else set on the instance — accelerate's
``add_hook_to_module`` (``dispatch_model``, ``cpu_offload``) does — is never inside a fused unit:
its forward runs once per call and its result is used, as unfused. Checked with a hook that passes
the output through and one that changes it, on each position of a run (first Linear, activation,
last Linear), in an ``nn.Sequential``, in a forward calling its children, and in a run through
child forwards; with accelerate itself where it is installed."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from ckpt_ext import fuse


def add_hook(module: nn.Module, counter: list, scale: float) -> None:
    """What accelerate's add_hook_to_module does: the instance's forward becomes a wrapper that
    calls the forward it replaced."""
    module._old_forward = module.forward

    def new_forward(module, *args, **kwargs):
        counter[0] += 1
        out = module._old_forward(*args, **kwargs)
        return out * scale if scale != 1.0 else out

    module.forward = functools.update_wrapper(functools.partial(new_forward, module),
                                              module._old_forward)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x))) + x


class Up(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act = nn.Linear(8, 16), nn.Tanh()

    def forward(self, x):
        return self.act(self.fc1(x))


class Down(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc2 = nn.Linear(16, 8)

    def forward(self, h, x):
        return self.fc2(h) + x


class Crossing(nn.Module):
    """A run through child forwards: Up.forward's fc1 -> act, then Down.forward's fc2."""

    def __init__(self):
        super().__init__()
        self.up, self.down = Up(), Down()

    def forward(self, x):
        return self.down(self.up(x), x)


def _sequential():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh())


def _wrapped_sequential():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
            self.head = nn.Linear(16, 8)

        def forward(self, x):
            return self.head(self.trunk(x)) + x
    return Outer()


LAYOUTS = {
    "sequential": (_sequential, ["0", "1", "2"]),
    "children": (Block, ["fc1", "act", "fc2"]),
    "crossing": (Crossing, ["up.fc1", "up.act", "down.fc2"]),
    "sequential then child": (_wrapped_sequential, ["trunk.0", "trunk.1", "head"]),
}


def _fused_without_hook(make):
    torch.manual_seed(0)
    _, report = fuse(make())
    assert report.fused  # the layout fuses when nothing is hooked


@pytest.mark.parametrize("scale", [1.0, 3.0], ids=["pass_through", "changes_output"])
@pytest.mark.parametrize("position", [0, 1, 2], ids=["first_linear", "activation", "last_linear"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_instance_forward_runs_once_and_its_result_is_used(layout, position, scale):
    make, names = LAYOUTS[layout]
    _fused_without_hook(make)
    torch.manual_seed(0)
    plain = make()
    model = copy.deepcopy(plain)
    n_plain, n_fused = [0], [0]
    add_hook(plain.get_submodule(names[position]), n_plain, scale)
    add_hook(model.get_submodule(names[position]), n_fused, scale)

    _, report = fuse(model)

    x = torch.randn(5, 8, dtype=torch.float32)
    want = plain(x)
    got = model(x)
    assert n_fused[0] == n_plain[0] == 1
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    hooked = names[position]
    assert all(hooked not in d.layers for d in report.fused)
    assert "set on the instance" in str(report)


@pytest.mark.parametrize("position", [0, 1, 2], ids=["first_linear", "activation", "last_linear"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_instance_forward_set_after_fuse_makes_the_run_compute_member_by_member(layout, position):
    make, names = LAYOUTS[layout]
    torch.manual_seed(0)
    plain = make()
    model = copy.deepcopy(plain)
    _, report = fuse(model)
    assert report.fused
    n_plain, n_fused = [0], [0]
    add_hook(plain.get_submodule(names[position]), n_plain, 3.0)
    add_hook(model.get_submodule(names[position]), n_fused, 3.0)
    x = torch.randn(5, 8)
    want, got = plain(x), model(x)
    assert n_fused[0] == n_plain[0] == 1
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("position", [0, 1, 2], ids=["first_linear", "activation", "last_linear"])
def test_with_accelerate_itself(position):
    hooks = pytest.importorskip("accelerate.hooks", reason="accelerate is not installed")

    class Scale(hooks.ModelHook):
        def __init__(self):
            self.calls = 0

        def post_forward(self, module, output):
            self.calls += 1
            return output * 2

    for make, names in LAYOUTS.values():
        torch.manual_seed(0)
        plain = make()
        model = copy.deepcopy(plain)
        h_plain, h_fused = Scale(), Scale()
        hooks.add_hook_to_module(plain.get_submodule(names[position]), h_plain)
        hooks.add_hook_to_module(model.get_submodule(names[position]), h_fused)
        _, report = fuse(model)
        x = torch.randn(5, 8)
        torch.testing.assert_close(model(x), plain(x), rtol=1e-6, atol=1e-6)
        assert h_fused.calls == h_plain.calls == 1
        assert all(names[position] not in d.layers for d in report.fused)
