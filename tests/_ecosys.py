"""Helpers of the ecosystem tests (converter, compile, autocast, double backward, distributed):
the model shapes users bring. The error measure is the suite's one, from reference.py.
"""
from __future__ import annotations


import torch
from torch import Tensor, nn

from reference import measured, rel_err  # noqa: F401  (rel_err re-exported for the ecosystem tests)


# ------------------------------------------------------------------------------------------------
# Real-world model shapes

def Net(d_in: int = 12, d_hidden: int = 40, dtype=None) -> nn.Module:
    """The write-up's network, ckpt_ext.models.Net in plain mode, at test sizes: linear1, then
    three Sequential(Linear, Tanh) blocks."""
    from ckpt_ext.models import Net as WriteupNet

    return WriteupNet(in_features=d_in, hidden=d_hidden, depth=3, mode="plain", dtype=dtype)


class ActorCritic(nn.Module):
    """A policy/value MLP built the way RL libraries build it (Stable-Baselines3's MlpExtractor +
    heads, CleanRL's Agent): separate Sequential(Linear, Tanh, Linear, Tanh) trunks for policy and
    value, then linear heads."""

    def __init__(self, obs_dim: int = 11, act_dim: int = 3, hidden: int = 64, dtype=None) -> None:
        super().__init__()

        def trunk():
            return nn.Sequential(nn.Linear(obs_dim, hidden, dtype=dtype), nn.Tanh(),
                                 nn.Linear(hidden, hidden, dtype=dtype), nn.Tanh())

        self.policy_net = trunk()
        self.value_net = trunk()
        self.action_net = nn.Linear(hidden, act_dim, dtype=dtype)
        self.value_head = nn.Linear(hidden, 1, dtype=dtype)
        self.log_std = nn.Parameter(torch.zeros(act_dim, dtype=dtype))

    def forward(self, obs: Tensor):
        return self.action_net(self.policy_net(obs)), self.value_head(self.value_net(obs))


class BertPooler(nn.Module):
    """Hugging Face's BertPooler, verbatim in structure: first token -> dense -> activation."""

    def __init__(self, hidden: int, dtype=None) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden, dtype=dtype)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: Tensor) -> Tensor:
        first_token_tensor = hidden_states[:, 0]
        pooled_output = self.dense(first_token_tensor)
        pooled_output = self.activation(pooled_output)
        return pooled_output


class TinyBert(nn.Module):
    """A BERT-shaped model whose top-level forward torch.fx cannot trace (an optional mask and a
    data-dependent branch, as in real encoders); the pooler inside it still gets fused."""

    def __init__(self, vocab: int = 50, hidden: int = 24, dtype=None) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab, hidden, dtype=dtype)
        self.encoder = nn.TransformerEncoderLayer(hidden, nhead=2, dim_feedforward=32,
                                                  dropout=0.0, batch_first=True, dtype=dtype)
        self.pooler = BertPooler(hidden, dtype=dtype)

    def forward(self, input_ids: Tensor, attention_mask=None):
        h = self.embeddings(input_ids)
        if attention_mask is not None and bool((attention_mask == 0).any()):
            h = self.encoder(h, src_key_padding_mask=attention_mask == 0)
        else:
            h = self.encoder(h)
        return h, self.pooler(h)


def outputs_and_grads(model: nn.Module, *inputs, grad_input: bool = True):
    """Flattened outputs, input grads and parameter grads (by name) of sum(outputs²)."""
    inputs = [i.detach().clone().requires_grad_(grad_input and i.is_floating_point())
              for i in inputs]
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    loss = sum((o.float() ** 2).sum() for o in outs)
    loss.backward()
    # torch.compile's wrapper names parameters "_orig_mod.<name>"
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone()
             for n, p in model.named_parameters() if p.grad is not None}
    in_grads = [i.grad for i in inputs if i.requires_grad]
    return [o.detach() for o in outs], in_grads, grads


# ------------------------------------------------------------------------------------------------
# What autograd keeps



def assert_same_outputs_and_grads(key: str, tol: float, before: nn.Module, after: nn.Module,
                                  *inputs) -> None:
    """Outputs, input grads and every parameter grad of ``after`` within ``tol`` of ``before``'s
    (``rel_err``, recorded under ``key``)."""
    out_b, in_b, g_b = outputs_and_grads(before, *inputs)
    out_a, in_a, g_a = outputs_and_grads(after, *inputs)
    for a, b in zip(out_a + in_a, out_b + in_b):
        assert measured(key, rel_err(a, b)) <= tol
    assert g_a.keys() == g_b.keys() and len(g_b) > 0
    for name in g_b:
        assert measured(key, rel_err(g_a[name], g_b[name])) <= tol, name

def saved_activation_bytes(model: nn.Module, *inputs, run=None) -> int:
    """Bytes of the distinct storages autograd saves for backward while running ``model`` (or
    ``run(*inputs)``, a call of it), not counting the parameters (which the model holds anyway).
    Exact: it sees every saved tensor."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = (run or model)(*inputs)
    del out
    return sum(saved.values())


def kept_bytes(model: nn.Module, x: Tensor) -> int:
    """CPU tensor bytes still alive after forward and a ``.sum()`` loss, with the output dropped:
    what autograd keeps for backward, counted by ckpt_ext's exact allocator meter."""
    from ckpt_ext.memory import MemoryMeter

    with MemoryMeter("cpu") as meter:
        x = x.clone()
        before = meter.current()
        out = model(x)
        loss = out.sum()
        del out
        kept = meter.current() - before - loss.untyped_storage().nbytes()
        loss.backward()
    return kept


# ------------------------------------------------------------------------------------------------
# generate() of a fused model against its unfused copy

def assert_same_greedy_tokens(plain: nn.Module, fused: nn.Module, ids: Tensor, tol: float,
                              key: str, **kw) -> None:
    """Greedy ``generate()`` of a fused model against the unfused copy. The fused MLPs run other
    kernels (ckpt_ext's activation, its GEMMs into buffers of its own), so the logits agree within
    a bound, not to the bit: each step's logits within ``tol`` (``rel_err``, recorded under
    ``key``), and each step's tokens equal wherever the unfused step's two best scores lie more
    than ``2·tol·‖logits‖`` apart, the most the bound lets an argmax move. At a nearer tie either
    token is right: the two generations part there, and the comparison ends."""
    kw = dict(kw, do_sample=False, return_dict_in_generate=True, output_logits=True,
              output_scores=True)
    a, b = plain.generate(ids, **kw), fused.generate(ids, **kw)
    # generated tokens; while they agree, both runs stop at the same step
    ta, tb = a.sequences[:, -len(a.logits):], b.sequences[:, -len(b.logits):]
    for i in range(min(len(a.logits), len(b.logits))):
        assert measured(key, rel_err(b.logits[i], a.logits[i])) <= tol, f"step {i}"
        if torch.equal(ta[:, i], tb[:, i]):
            continue
        top2 = a.scores[i].double().topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1])[ta[:, i] != tb[:, i]]
        assert (margin <= 2 * tol * a.logits[i].double().norm()).all(), \
            f"step {i}: another token where the margin was {margin.min().item():.3g}"
        return
    assert torch.equal(a.sequences, b.sequences)
