"""Bart and Whisper: their layers' MLP, ``fc2(F.dropout(activation_fn(fc1(h)), p, training))``,
is one unit per layer. The encoder layer's forward branches on its output after the MLP (a
float16 overflow check fx cannot decide): it is analysed up to that branch. The decoder layer
tests ``encoder_hidden_states`` against None: traced given, and a call without it runs the
class's forward. Outputs, every gradient (train, with dropouts and activation dropout, same seed;
eval) and ``generate()`` as unfused, from tiny configs (nothing downloaded)."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from ckpt_ext import fuse, unfuse
from _ecosys import assert_same_greedy_tokens

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

F64 = torch.float64
# Measured (CPU, float64): outputs within 4e-16 and gradients within 1e-15 of the unfused
# copy's, relative to the largest; 1e-13 as the zoo's.
TOL = 1e-13
# generate()'s float64 logits: measured 0 against the unfused model; the unfused model's own
# under other MKL/oneDNN/ATen kernels move by up to 1.6e-16 relative, so ~10x that.
GENERATE_TOL = 1.5e-15


def _bart(cls="BartForConditionalGeneration"):
    return getattr(transformers, cls)(transformers.BartConfig(
        vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=32, dropout=0.1, activation_dropout=0.1, attention_dropout=0.0))


def _whisper():
    return transformers.WhisperModel(transformers.WhisperConfig(
        vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        activation_dropout=0.1, dropout=0.1))


def _pair(make):
    torch.manual_seed(0)
    plain = make().double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    return plain, fused, report


def _step(model, kwargs, seed):
    torch.manual_seed(seed)
    out = model(**kwargs)
    y = out.logits if hasattr(out, "logits") else out.last_hidden_state
    params = [p for p in model.parameters() if p.requires_grad]
    return [y] + list(torch.autograd.grad(y.square().sum(), params, allow_unused=True))


def _same(plain, fused, kwargs, seed=1):
    a, b = _step(plain, kwargs, seed), _step(fused, kwargs, seed)
    scale = max(x.abs().max() for x in a if x is not None)
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), i
        if x is not None:
            assert ((x - y).abs().max() / scale).item() <= TOL, i


def _bart_inputs():
    g = torch.Generator().manual_seed(2)
    return {"input_ids": torch.randint(1, 50, (2, 7), generator=g),
            "decoder_input_ids": torch.randint(1, 50, (2, 5), generator=g)}


def _whisper_inputs():
    g = torch.Generator().manual_seed(2)
    return {"input_features": torch.randn(2, 8, 16, dtype=F64, generator=g),
            "decoder_input_ids": torch.randint(1, 50, (2, 5), generator=g)}


@pytest.mark.parametrize("name", ["bart", "whisper"])
def test_every_layers_mlp_is_one_unit_and_exact(name):
    make, inputs = {"bart": (_bart, _bart_inputs), "whisper": (_whisper, _whisper_inputs)}[name]
    plain, fused, report = _pair(make)
    layers = 3 if name == "bart" else 2
    assert len(report.fused) == layers, str(report)
    for d in report.fused:
        assert d.layers[0].endswith("fc1") and d.layers[-1].endswith("fc2"), str(report)
        assert "F.dropout, between its Linears, run on a zero-width placeholder" in d.why
    decoder = [d for d in report.fused if ".decoder." in f".{d.where}." or
               d.where.startswith("decoder") or ".decoder." in d.layers[0]]
    assert decoder and all("calls giving encoder_hidden_states (not None)" in d.why
                           for d in decoder), str(report)
    assert any("up to line" in why and "branches on a traced value" in why
               for _, why in report.not_analysed), report.not_analysed
    for mode in (True, False):
        plain.train(mode)
        fused.train(mode)
        _same(plain, fused, inputs())


def test_bart_generate_gives_the_same_tokens():
    plain, fused, _ = _pair(_bart)
    plain.eval()
    fused.eval()
    ids = _bart_inputs()["input_ids"]
    # float64 logits within GENERATE_TOL of the unfused model's (not bitwise: the fused MLP's
    # GELU is ckpt_ext's kernel)
    assert_same_greedy_tokens(plain, fused, ids, GENERATE_TOL, "fuse.bart.generate",
                              max_new_tokens=6, num_beams=1, decoder_start_token_id=2)


def test_decoder_without_encoder_states_runs_the_class_forward():
    """BartForCausalLM: no encoder_hidden_states, so each decoder layer's call breaks the
    guard and computes module by module, exact."""
    plain, fused, report = _pair(lambda: _bart("BartForCausalLM"))
    assert len(report.fused) == 2 and all("calls giving encoder_hidden_states" in d.why
                                          for d in report.fused), str(report)
    ids = _bart_inputs()["decoder_input_ids"]
    kwargs = {"input_ids": ids, "use_cache": False}
    a, b = _step(plain, kwargs, 1), _step(fused, kwargs, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b) if x is not None)


def test_unfuse_gives_back_the_layers():
    _, fused, _ = _pair(_bart)
    unfuse(fused)
    for layer in list(fused.model.encoder.layers) + list(fused.model.decoder.layers):
        assert "forward" not in vars(layer) and type(layer.fc1) is torch.nn.Linear
