"""The models the fuse tests convert, each as a factory: ``MODELS[name]()`` returns
``(model, inputs, rows)``, a fresh model in train mode, the inputs of one call and the number of
rows (samples, or tokens) its Linear layers see; ``FUSE_KWARGS.get(name, {})`` are the arguments
``fuse`` takes for it (``rewrite=True`` for forward code). tests/fuse/test_fuse_claims.py checks every
report figure against the bytes autograd keeps on each of them; a model added here is checked
there. It holds each shape of model the other fuse tests fuse (their classes, imported) and
each activation of the registry in each module and functional spelling. Models of a library that
is not installed are absent (``requires`` says which)."""
from __future__ import annotations

import importlib.util
import os
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ckpt_ext._activations import REGISTRY
from _ecosys import ActorCritic, Net, TinyBert

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

Factory = Callable[[], Tuple[nn.Module, tuple, int]]
MODELS: Dict[str, Factory] = {}
FUSE_KWARGS: Dict[str, dict] = {}


def model(name: str, requires: str = "", **fuse_kwargs):
    def register(fn: Factory) -> Factory:
        if not requires or importlib.util.find_spec(requires) is not None:
            MODELS[name] = fn
            if fuse_kwargs:
                FUSE_KWARGS[name] = fuse_kwargs
        return fn
    return register


def _x(rows: int, d: int, dtype=torch.float32):
    return torch.randn(rows, d, dtype=dtype)


# -- plain torch --------------------------------------------------------------------------------

@model("mlp tanh (docs' policy)")
def _mlp_tanh():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4)), (_x(32, 8),), 32


@model("write-up Net")
def _net():
    torch.manual_seed(0)
    return Net(16, 32), (_x(32, 16),), 32


@model("actor-critic")
def _actor_critic():
    torch.manual_seed(0)
    return ActorCritic(), (_x(16, 11),), 16


@model("gelu block")
def _gelu_block():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x))) + x
    torch.manual_seed(0)
    return Block(), (_x(24, 16),), 24


@model("silu sequential, trailing")
def _silu():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU()), \
        (_x(16, 8),), 16


@model("rl actor: relu, relu, tanh (one mixed run)")
def _rl_actor():
    from test_fuse_mixed import actor
    torch.manual_seed(0)
    return actor(), (_x(16, 11),), 16


@model("tanh, gelu (one mixed run)")
def _tanh_gelu():
    from test_fuse_mixed import tanh_gelu
    torch.manual_seed(0)
    return tanh_gelu(), (_x(16, 6),), 16


@model("relu, dropout p=0, linear")
def _dropout0():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Dropout(0.0), nn.Linear(256, 16)), \
        (_x(16, 16),), 16


class TimmMlp(nn.Module):
    """timm's ``layers.Mlp`` as timm writes it (``drop=0``, ``norm_layer=None``): Dropout and
    Identity modules between the activation and ``fc2``."""

    def __init__(self, d: int = 16, hidden: int = 64, drop: float = 0.0):
        super().__init__()
        self.fc1, self.act, self.drop1 = nn.Linear(d, hidden), nn.GELU(), nn.Dropout(drop)
        self.norm, self.fc2, self.drop2 = nn.Identity(), nn.Linear(hidden, d), nn.Dropout(drop)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


def torchvision_mlp(d: int = 16, hidden: Tuple[int, ...] = (64, 64, 16), dropout: float = 0.0):
    """torchvision's ``ops.MLP(d, hidden, dropout=...)``: a Sequential of Linear, ReLU, Dropout
    per hidden layer, then Linear, Dropout."""
    layers, width = [], d
    for h in hidden[:-1]:
        layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(dropout)]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, hidden[-1]), nn.Dropout(dropout))


@model("timm Mlp (dropout 0, Identity norm)")
def _timm_mlp():
    torch.manual_seed(0)
    return TimmMlp(), (_x(16, 16),), 16


@model("timm Mlp, dropout 0.1 in eval")
def _timm_mlp_eval():
    torch.manual_seed(0)
    return TimmMlp(drop=0.1).eval(), (_x(16, 16),), 16


@model("timm Mlp, dropout 0.1 in training")
def _timm_mlp_dropout():
    torch.manual_seed(0)
    return TimmMlp(drop=0.1), (_x(16, 16),), 16


@model("torchvision ops.MLP (dropout 0)")
def _torchvision_mlp():
    torch.manual_seed(0)
    return torchvision_mlp(), (_x(16, 16),), 16


@model("torchvision ops.MLP, dropout 0.1 in training")
def _torchvision_mlp_dropout():
    torch.manual_seed(0)
    return torchvision_mlp(dropout=0.1), (_x(16, 16),), 16


@model("relu, dropout p=0.1, linear")
def _dropout1():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 16)), \
        (_x(16, 16),), 16


@model("tanh pair into a residual add")
def _pair_add():
    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act = nn.Linear(16, 16), nn.Tanh()

        def forward(self, x):
            return self.act(self.fc(x)) + x
    torch.manual_seed(0)
    return Res(), (_x(16, 16),), 16


@model("tiny bert (torch encoder layer, pooler)")
def _tiny_bert():
    torch.manual_seed(0)
    # one token per sequence: the encoder's MLP and the pooler both see 4 rows
    return TinyBert(), (torch.randint(0, 50, (4, 1)),), 4


@model("crossing child forwards")
def _crossing():
    class Up(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act = nn.Linear(8, 32), nn.GELU()

        def forward(self, x):
            return self.act(self.fc(x))

    class Down(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 8)

        def forward(self, h, skip):
            return self.fc(h) + skip

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = Up(), Down()

        def forward(self, x):
            return self.down(self.up(x), x)
    torch.manual_seed(0)
    return Stack(), (_x(16, 8),), 16


@model("crossing stack (test_fuse_crossing)")
def _stack():
    from test_fuse_crossing import Stack
    torch.manual_seed(0)
    return Stack(), (_x(16, 6),), 16


@model("functional forward, rewritten", rewrite=True)
def _functional():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Parameter(torch.randn(32, 8)), nn.Parameter(torch.randn(4, 32))

        def forward(self, x):
            return F.linear(F.silu(F.linear(x, self.w1)), self.w2)
    torch.manual_seed(0)
    return Functional(), (_x(16, 8),), 16


# -- real libraries ------------------------------------------------------------------------------

@model("stable-baselines3 PPO policy", requires="stable_baselines3")
def _ppo():
    import stable_baselines3 as sb3
    from stable_baselines3.common.logger import Logger
    torch.manual_seed(0)
    ppo = sb3.PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, seed=0, device="cpu")
    ppo.set_logger(Logger(None, []))  # configure() would make a folder in /tmp
    return ppo.policy, (_x(16, 4),), 16


@model("stable-baselines3 TD3 actor", requires="stable_baselines3")
def _td3_actor():
    import stable_baselines3 as sb3
    torch.manual_seed(0)
    td3 = sb3.TD3("MlpPolicy", "Pendulum-v1", policy_kwargs={"net_arch": [32, 32]}, seed=0,
                  device="cpu")
    return td3.actor, (_x(16, 3),), 16


@model("deepxde FNN (tanh), rewritten", requires="deepxde", rewrite=True)
def _deepxde():
    os.environ.setdefault("DDE_BACKEND", "pytorch")
    device = torch.get_default_device()
    try:  # deepxde makes a visible GPU torch's default device on import
        import deepxde as dde
    finally:
        torch.set_default_device(device)
    torch.manual_seed(0)
    return dde.nn.FNN([1, 16, 16, 1], "tanh", "Glorot normal"), (_x(33, 1),), 33


# -- transformers, from tiny configs (nothing downloaded) ----------------------------------------

class LastHidden(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.model = inner

    def forward(self, ids):
        return self.model(input_ids=ids).last_hidden_state


def bert(**overrides) -> nn.Module:
    """A transformers BertModel from a tiny config (hidden 32, 2 layers of 2 heads, intermediate
    64, no dropout), seeded; ``overrides`` change the config. The fuse tests build theirs here."""
    import transformers
    config = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    config.update(overrides)
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(**config))


def distilbert(**overrides) -> nn.Module:
    """A transformers DistilBertModel from a tiny config (dim 32, 2 layers of 2 heads, hidden 64,
    no dropout), seeded; ``overrides`` change the config."""
    import transformers
    config = dict(vocab_size=99, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                  max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)
    config.update(overrides)
    torch.manual_seed(0)
    return transformers.DistilBertModel(transformers.DistilBertConfig(**config))


@model("bert", requires="transformers")
def _bert():
    return LastHidden(bert()), (torch.randint(0, 99, (3, 7)),), 21


@model("bert, gelu_pytorch_tanh, feed-forward in chunks of 4", requires="transformers")
def _bert_chunked():
    return LastHidden(bert(hidden_act="gelu_pytorch_tanh", chunk_size_feed_forward=4)), \
        (torch.randint(0, 99, (3, 8)),), 24


@model("bert, intermediate 37 (test_libraries)", requires="transformers")
def _bert_37():
    return LastHidden(bert(intermediate_size=37)), (torch.randint(0, 99, (3, 7)),), 21


@model("distilbert", requires="transformers")
def _distilbert():
    return LastHidden(distilbert()), (torch.randint(0, 99, (3, 7)),), 21


@model("t5 encoder, dropout 0", requires="transformers")
def _t5():
    import transformers
    config = transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_heads=2, dropout_rate=0.0, feed_forward_proj="relu")
    torch.manual_seed(0)
    return LastHidden(transformers.T5EncoderModel(config)), (torch.randint(0, 99, (3, 7)),), 21


@model("gpt2", requires="transformers")
def _gpt2():
    import transformers
    config = transformers.GPT2Config(vocab_size=99, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return LastHidden(transformers.GPT2Model(config)), (torch.randint(0, 99, (3, 7)),), 21


@model("phi3", requires="transformers")
def _phi3():
    import transformers
    config = transformers.Phi3Config(vocab_size=99, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=2, max_position_embeddings=64,
                                     pad_token_id=0)
    torch.manual_seed(0)
    return LastHidden(transformers.Phi3Model(config)), (torch.randint(0, 99, (3, 7)),), 21


def _decoder(config_class: str, model_class: str, **kw):
    def factory():
        import transformers
        config = getattr(transformers, config_class)(
            vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, **kw)
        torch.manual_seed(0)
        return LastHidden(getattr(transformers, model_class)(config)), \
            (torch.randint(0, 99, (3, 7)),), 21
    return factory


for _name, _args in {"llama": ("LlamaConfig", "LlamaModel"),
                     "mistral": ("MistralConfig", "MistralModel"),
                     "qwen2": ("Qwen2Config", "Qwen2Model")}.items():
    model(_name, requires="transformers")(_decoder(*_args))
model("gemma, gelu_pytorch_tanh", requires="transformers")(
    _decoder("GemmaConfig", "GemmaModel", hidden_activation="gelu_pytorch_tanh", head_dim=16))
model("llama, mlp_bias", requires="transformers")(
    _decoder("LlamaConfig", "LlamaModel", mlp_bias=True))


def _t5_gated(dropout: float, ff: str = "gated-gelu_pytorch_tanh"):
    def factory():
        import transformers
        config = transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                       num_heads=2, dropout_rate=dropout, feed_forward_proj=ff)
        torch.manual_seed(0)
        return LastHidden(transformers.T5EncoderModel(config)), \
            (torch.randint(0, 99, (3, 7)),), 21
    return factory


model("t5 encoder, gated-gelu_pytorch_tanh", requires="transformers")(_t5_gated(0.0))
model("t5 encoder, gated-gelu_pytorch_tanh, dropout 0.1 in training",
      requires="transformers")(_t5_gated(0.1))
# gated-gelu: transformers' NewGELUActivation, a formula of several ops, keeps four tensors
model("t5 encoder, gated-gelu", requires="transformers")(_t5_gated(0.0, "gated-gelu"))


class GatedMLP(nn.Module):
    """A hand-written gated MLP: ``w2(act(w1(x)) * w3(x))``, or with one packed Linear split by
    ``chunk(2, dim=-1)`` (``packed``; ``second``: the activation on the second half), or with
    the product's operands swapped (``up_first``)."""

    def __init__(self, act=F.silu, packed=False, second=False, up_first=False, d=16, i=48):
        super().__init__()
        self.act, self.packed, self.second, self.up_first = act, packed, second, up_first
        if packed:
            self.w13 = nn.Linear(d, 2 * i)
        else:
            self.w1, self.w3 = nn.Linear(d, i), nn.Linear(d, i)
        self.w2 = nn.Linear(i, d)

    def forward(self, x):
        if self.packed:
            a, b = self.w13(x).chunk(2, dim=-1)
            gate, up = (b, a) if self.second else (a, b)
        else:
            gate, up = self.w1(x), self.w3(x)
        h = up * self.act(gate) if self.up_first else self.act(gate) * up
        return self.w2(h)


def _gated(**kw):
    def factory():
        torch.manual_seed(0)
        return GatedMLP(**kw), (_x(24, 16),), 24
    return factory


model("gated, F.silu")(_gated())
model("gated, packed tanh")(_gated(act=torch.tanh, packed=True))
model("gated, packed silu, gate second")(_gated(packed=True, second=True))
model("gated, up * sigmoid(gate)")(_gated(act=torch.sigmoid, up_first=True))


# -- every activation of the registry, in each spelling the fuse tests use ----------------------

def _act_sequential(make):
    def factory():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), make(), nn.Linear(16, 12), make(),
                             nn.Linear(12, 3)), (_x(8, 6),), 8
    return factory


def _act_children(make):
    def factory():
        from test_fuse_activations import Children
        torch.manual_seed(0)
        return Children(make, last_act=True), (_x(8, 6),), 8
    return factory


def _act_functional(fn):
    def factory():
        from test_fuse_activations import Functional
        torch.manual_seed(0)
        return Functional(fn), (_x(8, 6),), 8
    return factory


class OwnSin(nn.Module):
    """A user's own sine, as PINN code writes it (tests/ops/test_activation_registry.py)."""

    def forward(self, x):
        return torch.sin(x)


_MODULE_SPELLINGS = {f"{row.display} module": row.module for row in REGISTRY.values()}
_MODULE_SPELLINGS["nn.ReLU(inplace) module"] = lambda: nn.ReLU(inplace=True)
_MODULE_SPELLINGS["own Sin module"] = OwnSin
for _spelling, _make in _MODULE_SPELLINGS.items():
    model(f"{_spelling}, sequential run")(_act_sequential(_make))
    model(f"{_spelling}, children with a trailing activation")(_act_children(_make))


@model("CLIP vision (quick_gelu)", requires="transformers")
def _clip_vision():
    import transformers
    config = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=2,
                                           image_size=16, patch_size=8, hidden_act="quick_gelu",
                                           attention_dropout=0.0)
    torch.manual_seed(0)
    return _PixelsLastHidden(transformers.CLIPVisionModel(config)), \
        (torch.randn(3, 3, 16, 16),), 15  # 3 images: the class token and 4 patches each


class _PixelsLastHidden(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.model = inner

    def forward(self, pixels):
        return self.model(pixel_values=pixels).last_hidden_state


def _call(form):
    return lambda h: form.fn(h, **dict(form.want))


def _method(name):
    return lambda h: getattr(h, name)()


for _row in REGISTRY.values():
    for _form in _row.calls:
        model(f"{_form.label}({dict(_form.want) or ''}) functional, rewritten",
              rewrite=True)(_act_functional(_call(_form)))
    for _name in _row.methods:
        model(f".{_name}() functional, rewritten", rewrite=True)(_act_functional(_method(_name)))
model("F.relu(inplace) functional, rewritten", rewrite=True)(
    _act_functional(lambda h: F.relu(h, inplace=True)))


# -- the other fuse tests' models, one per shape --------------------------------------------------

def _from(module: str, name: str, *args, rows: int = 8, d: int = 6, **kwargs):
    """A factory of ``module.name(*args)`` (a tests/fuse module's class), on ``rows`` × ``d``."""
    def factory():
        cls = getattr(importlib.import_module(module), name)
        torch.manual_seed(0)
        return cls(*args), (_x(rows, d),), rows
    model(f"{module}.{name}{args if args else ''}", **kwargs)(factory)
    return factory


class _RK4(nn.Module):
    """Fixed-step RK4 over ``func(t, y)`` from 0 to 1: 4 evaluations per step."""

    def __init__(self, func: nn.Module, steps: int = 4):
        super().__init__()
        self.func, self.steps = func, steps

    def forward(self, y):
        h, t = 1.0 / self.steps, 0.0
        for _ in range(self.steps):
            k1 = self.func(t, y)
            k2 = self.func(t + h / 2, y + h / 2 * k1)
            k3 = self.func(t + h / 2, y + h / 2 * k2)
            k4 = self.func(t + h, y + h * k3)
            y, t = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4), t + h
        return y


def _rk4(module: str, name: str, d: int, batch: int = 4, **kwargs):
    def factory():
        cls = getattr(importlib.import_module(module), name)
        torch.manual_seed(0)
        return _RK4(cls()), (_x(batch, d),), batch * 16
    model(f"{module}.{name} under rk4", **kwargs)(factory)


# test_convert
@model("test_convert.ODEFunc (t, y), rewritten", rewrite=True)
def _ode_func():
    from test_convert import ODEFunc
    torch.manual_seed(0)
    return ODEFunc(), (0.0, _x(8, 3)), 8


_from("test_convert", "Policy", rewrite=True)
# the fused op keeps the buffer bias b (5 floats), which the meter counts: 256 rows keep that
# constant 20 B under 1 % of each figure (policy="all" claims 20 B per row)
_from("test_convert", "FunctionalForms", "torch.tanh", d=10, rows=256, rewrite=True)
_from("test_convert", "FunctionalForms", "nn.Tanh", d=10, rows=256, rewrite=True)
_from("test_convert", "LinearsInModuleList", True, d=4, rewrite=True)
_from("test_convert", "LinearsInModuleList", False, d=4, rewrite=True)
for _consumer in ("LayerNorm", "F.layer_norm", "matmul", "multiply by a tensor", "F.mse_loss",
                  "multiply by a constant"):
    _from("test_convert", "PairInto", _consumer, rewrite=True)
    _from("test_convert", "PairInto", _consumer, True, rewrite=True)
_from("test_convert", "Chain", d=4)
_from("test_convert", "TwiceCalled", d=4)
_from("test_convert", "Through", d=4)
_from("test_convert", "BodyThenChildren", d=4)
_from("test_convert", "PairThenSequential", d=3)
_from("test_convert", "LoopOverBlocks")


@model("test_convert nested sequentials")
def _nested():
    from test_convert import _nested as make
    torch.manual_seed(0)
    return make(), (_x(8, 4),), 8


# test_fuse_callers
_from("test_fuse_callers", "WithMethods", d=11)
_from("test_fuse_callers", "Nested", d=4)
_from("test_fuse_callers", "FNN", d=1, rewrite=True)
_rk4("test_fuse_callers", "Dynamics", 16)
_rk4("test_fuse_callers", "SequentialDynamics", 16)
_from("test_fuse_callers", "Outer", d=4)
_from("test_fuse_callers", "ClassFlag", d=4, rewrite=True)

# test_fuse_mixed
_from("test_fuse_mixed", "Children")
_from("test_fuse_mixed", "Functional", rewrite=True)

# test_fuse_crossing
_from("test_fuse_crossing", "Twice")
_from("test_fuse_crossing", "Layer")
_from("test_fuse_crossing", "TwoMethods")
_from("test_fuse_crossing", "Nested", d=5)
_from("test_fuse_crossing", "Producer", d=4)

# test_fuse_instance_forward: each layout, and each with its activation's forward set on the
# instance (accelerate's hooks)
for _layout in ("sequential", "children", "crossing", "sequential then child"):
    for _hooked in (False, True):
        def _instance(layout=_layout, hooked=_hooked):
            import test_fuse_instance_forward as t
            make, names = t.LAYOUTS[layout]
            torch.manual_seed(0)
            m = make()
            if hooked:
                t.add_hook(m.get_submodule(names[1]), [0], 3.0)
            return m, (_x(8, 8),), 8
        model(f"instance forward: {_layout}{', activation hooked' if _hooked else ''}")(_instance)


# test_libraries: torchdiffeq's odeint over a tanh MLP (rk4, 8 steps of 4 evaluations)
@model("torchdiffeq odeint (test_libraries)", requires="torchdiffeq")
def _odeint():
    from test_libraries import Dynamics, Solve
    torch.manual_seed(0)
    return Solve(Dynamics(hidden=16)), (_x(4, 2),), 4 * 32
