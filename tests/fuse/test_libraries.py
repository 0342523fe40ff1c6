"""ckpt_ext.fuse on models built by real libraries (test extras in requirements.txt): a
stable-baselines3 PPO policy trains like its unfused copy, a transformers BertModel keeps its
outputs and its save_pretrained/from_pretrained round trip, and a torchdiffeq Neural ODE keeps far
fewer bytes for backward with the same gradients.

Nothing is downloaded: the environment is gymnasium's built-in CartPole, the BERT config is built
in code (and the hub is switched off), the ODE is solved on random data. A test is skipped, with
the reason, only where its library is not installed.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from ckpt_ext import fuse
from ckpt_ext.convert import FusedSequential, RunLinear, RunTanh
from _ecosys import rel_err, saved_activation_bytes
from _fuse_models import bert

# Before transformers is imported: it reads these at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _need(module: str):
    return pytest.importorskip(module, reason=f"{module} is not installed (pip install -r "
                                              f"requirements.txt installs it)")


# ------------------------------------------------------------------------------------------------
# stable-baselines3: PPO("MlpPolicy") on CartPole


def _ppo(seed: int, folder):
    sb3 = _need("stable_baselines3")
    _need("gymnasium")
    from stable_baselines3.common.logger import configure
    model = sb3.PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, n_epochs=2,
                    seed=seed, device="cpu")
    # learn() would otherwise make a log folder of its own under the system's temp directory
    model.set_logger(configure(str(folder), []))
    return model


def test_sb3_ppo_fused_trains_like_the_unfused_copy(tmp_path):
    plain, fused = _ppo(0, tmp_path), _ppo(0, tmp_path)
    for p, q in zip(plain.policy.parameters(), fused.policy.parameters()):
        assert torch.equal(p, q)  # same seed, same start
    start = {n: p.detach().clone() for n, p in fused.policy.named_parameters()}
    keys = list(fused.policy.state_dict())

    policy, report = fuse(fused.policy)  # after PPO built its optimizer over the parameters

    assert policy is fused.policy
    extractor = fused.policy.mlp_extractor
    assert type(extractor.policy_net) is FusedSequential  # Linear, Tanh, Linear as one run
    assert [d.layers for d in report.fused] == [
        ("mlp_extractor.policy_net.0", "mlp_extractor.policy_net.1", "mlp_extractor.policy_net.2"),
        ("mlp_extractor.value_net.0", "mlp_extractor.value_net.1", "mlp_extractor.value_net.2")]
    assert report.bytes_per_row == 2 * 64 * 4
    assert list(fused.policy.state_dict()) == keys

    for model in (plain, fused):  # the same global RNG state for each run
        model.set_random_seed(0)
        model.learn(total_timesteps=256)

    # The same actions were taken (same rewards), and the weights moved the same way.
    assert torch.equal(torch.as_tensor(plain.rollout_buffer.actions),
                       torch.as_tensor(fused.rollout_buffer.actions))
    assert torch.equal(torch.as_tensor(plain.rollout_buffer.rewards),
                       torch.as_tensor(fused.rollout_buffer.rewards))
    for name in ("values", "log_probs"):
        a = torch.as_tensor(getattr(plain.rollout_buffer, name))
        b = torch.as_tensor(getattr(fused.rollout_buffer, name))
        assert rel_err(b, a) <= 1e-6, name  # measured 7e-8
    moved = 0
    for (name, p), q in zip(plain.policy.named_parameters(), fused.policy.parameters()):
        assert rel_err(q, p) <= 1e-6, name  # measured 1.5e-7 (float32)
        moved += not torch.equal(q, start[name])
    assert moved == len(start)  # the optimizer built before fusing trained every parameter

    # The fused policy's weights load into an unfused PPO (same keys).
    other = _ppo(1, tmp_path)
    other.policy.load_state_dict(fused.policy.state_dict(), strict=True)
    obs = torch.randn(5, 4)
    with torch.no_grad():
        assert rel_err(other.policy.predict_values(obs), fused.policy.predict_values(obs)) <= 1e-6


# ------------------------------------------------------------------------------------------------
# transformers: BertModel from a small config


def _bert():
    transformers = _need("transformers")
    return transformers, bert(intermediate_size=37).double()


def _bert_outputs_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask)
    (out.last_hidden_state.pow(2).sum() + out.pooler_output.pow(2).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.last_hidden_state.detach(), out.pooler_output.detach(), grads


def _pooler(decisions):
    """The decisions on the pooler (the encoder's MLPs are fused too:
    test_fuse_activations.py)."""
    return [d for d in decisions if d.layers[0].startswith("pooler.")]


def test_bert_pooler_fused_same_outputs_and_save_pretrained_round_trip(tmp_path):
    transformers, model = _bert()
    before = copy.deepcopy(model)
    keys = list(model.state_dict())
    ids = torch.randint(0, 99, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0

    # By default the pooler is a near miss: its output leaves through BertModel.forward, which
    # fx cannot use, so whether the caller keeps it is unknown.
    _, report = fuse(model)
    assert _pooler(report.fused) == [] and type(model.pooler.dense) is nn.Linear
    assert [d.layers for d in _pooler(report.near_misses)] == [
        ("pooler.dense", "pooler.activation")]
    assert "its caller <model> was not analysed" in _pooler(report.near_misses)[0].why

    _, report = fuse(model, policy="all")
    assert [(d.layers, d.how) for d in _pooler(report.fused)] == [
        (("pooler.dense", "pooler.activation"), "children")]
    assert type(model.pooler.dense) is RunLinear and type(model.pooler.activation) is RunTanh
    assert type(model) is transformers.BertModel and list(model.state_dict()) == keys

    h_b, p_b, g_b = _bert_outputs_and_grads(before, ids, mask)
    h_f, p_f, g_f = _bert_outputs_and_grads(model, ids, mask)
    assert rel_err(h_f, h_b) <= 1e-12 and rel_err(p_f, p_b) <= 1e-12
    assert g_f.keys() == g_b.keys() and len(g_b) > 0
    # Attention is invariant to the key bias (softmax ignores a shift along its axis), so its
    # gradient is zero up to rounding (~1e-21 here): relative to itself it is noise. Each gradient
    # is held to 1e-12 of its own norm, with a floor of 1e-15 of the largest gradient's norm.
    floor = 1e-15 * max(g.norm().item() for g in g_b.values())
    for name in g_b:
        diff = (g_f[name] - g_b[name]).norm().item()
        assert diff <= 1e-12 * g_b[name].norm().item() + floor, (name, diff)

    model.save_pretrained(tmp_path)
    loaded = transformers.BertModel.from_pretrained(tmp_path).double().eval()
    assert type(loaded.pooler.dense) is nn.Linear  # an ordinary BertModel again
    model.eval()
    with torch.no_grad():
        out_l = loaded(input_ids=ids, attention_mask=mask)
        out_f = model(input_ids=ids, attention_mask=mask)
    assert rel_err(out_l.pooler_output, out_f.pooler_output) <= 1e-6  # saved in float32
    assert rel_err(out_l.last_hidden_state, out_f.last_hidden_state) <= 1e-6
    _, again = fuse(loaded, policy="all")  # and the loaded model fuses the same way
    assert [d.layers for d in again.fused] == [d.layers for d in report.decisions
                                               if d.action != "left alone"]


# ------------------------------------------------------------------------------------------------
# torchdiffeq: a Neural ODE whose dynamics network is Linear, Tanh, Linear, Tanh, Linear


class Dynamics(nn.Module):
    def __init__(self, dim=2, hidden=64):
        super().__init__()
        self.nfe = 0
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                 nn.Tanh(), nn.Linear(hidden, dim))

    def forward(self, t, y):
        self.nfe += 1
        return self.net(y)


class Solve(nn.Module):
    def __init__(self, func):
        super().__init__()
        self.func = func

    def forward(self, y0):
        from torchdiffeq import odeint

        t = torch.linspace(0.0, 1.0, 3, dtype=y0.dtype)
        return odeint(self.func, y0, t, method="rk4", options={"step_size": 0.125})


def test_torchdiffeq_odeint_keeps_far_less_with_the_same_gradients():
    _need("torchdiffeq")
    torch.manual_seed(0)
    plain = Solve(Dynamics()).double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    assert [d.layers for d in report.fused] == [tuple(f"func.net.{i}" for i in range(5))]
    assert [p for p, _ in report.not_analysed] == [""]  # Solve (odeint); Dynamics is analysed
    assert fused.func.nfe == 0

    rows = 128
    y0 = torch.randn(rows, 2, dtype=torch.float64)
    saved_plain = saved_activation_bytes(plain, y0)
    saved_fused = saved_activation_bytes(fused, y0)
    evals = 32  # 8 RK4 steps of 4 evaluations
    assert plain.func.nfe == fused.func.nfe == evals
    assert saved_fused * 2 <= saved_plain  # required: at least 2x fewer bytes
    # What each evaluation keeps: plain its input and two 64-wide tanh outputs, fused its input.
    assert saved_plain - saved_fused == evals * rows * report.bytes_per_row
    print(f"odeint rk4, {evals} evaluations, {rows} rows, float64: saved for backward "
          f"{saved_plain:,} B unfused, {saved_fused:,} B fused ({saved_plain / saved_fused:.0f}x)")

    target = torch.randn(3, rows, 2, dtype=torch.float64)
    for model in (plain, fused):
        model.zero_grad()
        (model(y0) - target).pow(2).mean().backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert rel_err(q.grad, p.grad) <= 1e-12, name
