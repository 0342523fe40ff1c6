"""The tiny transformers Llama the plan tests step: hidden 64, intermediate 176 (Llama's ratio),
4 heads over 2 key-value heads, seeded weights."""
import torch


def tiny_llama(layers: int, seq: int, vocab: int):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=176,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=2 * seq)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)
