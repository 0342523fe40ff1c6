"""The models the fuse tests convert, each as a factory: ``MODELS[name]()`` returns
``(model, inputs, rows)``, a fresh model in train mode, the inputs of one call and the number of
rows (samples, or tokens) its Linear layers see; ``FUSE_KWARGS.get(name, {})`` are the arguments
``fuse`` takes for it (``rewrite=True`` for forward code). tests/fuse/test_fuse_claims.py checks every
report figure against the bytes autograd keeps on each of them; a model added here is checked
there. Models of a library that is not installed are absent (``requires`` says which)."""
from __future__ import annotations

import importlib.util
import os
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

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


@model("relu, dropout p=0, linear")
def _dropout0():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Dropout(0.0), nn.Linear(256, 16)), \
        (_x(16, 16),), 16


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
    return TinyBert(), (torch.randint(0, 50, (4, 5)),), 4


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
    from stable_baselines3.common.logger import configure
    torch.manual_seed(0)
    ppo = sb3.PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, seed=0, device="cpu")
    ppo.set_logger(configure(None, []))
    return ppo.policy, (_x(16, 4),), 16


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
