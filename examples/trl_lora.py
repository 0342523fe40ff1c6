"""SFT with LoRA under TRL, four ways side by side in one process, each from the same initial
weights and the same data: TRL's defaults (transformers' checkpointing on), ``CkptExtCallback()``,
``CkptExtCallback(budget)`` and plain (no checkpointing, no callback). Prints, per way, the peak
memory of one training step measured inside ``train()``, the median step time of steps with no
meter installed (the measured run's others and ``--rounds`` more runs), the final loss and, with the callback, ``ckpt_ext.stats``' fused and unfused
calls and the plan's predicted peak; a markdown table with its conditions above it.

    python examples/trl_lora.py                                   # a tiny Llama, CPU, nothing downloaded
    python examples/trl_lora.py --model PATH --seq 1024 --steps 8 # a local checkpoint, on a GPU

The tiny Llama is built from a config with a word-level tokenizer made in memory and trains on
token ids; ``--model`` loads ``AutoModelForCausalLM``/``AutoTokenizer`` from PATH (bfloat16 on
CUDA) and trains on a text data set the script writes. Docs: docs/trainers.md.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

import ckpt_ext  # noqa: E402
from ckpt_ext.integrations.transformers import CkptExtCallback  # noqa: E402
from ckpt_ext.memory import MemoryMeter  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WORDS = 1000  # the tiny model's vocabulary: words w0 .. w999, one token each
MiB = 2**20


# ---- the model, the tokenizer and the data ------------------------------------------------------

def tiny_tokenizer():
    import tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = tokenizers.models.WordLevel({f"w{i}": i for i in range(WORDS)}, unk_token="w0")
    tok = tokenizers.Tokenizer(vocab)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", eos_token="w1",
                                   bos_token="w2")


def tiny_llama(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=WORDS, hidden_size=args.hidden, intermediate_size=args.inter,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(1, args.hidden // 128), head_dim=64,
                      max_position_embeddings=max(args.seq, 128), use_cache=False,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def local_model(args, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                attn_implementation="sdpa")


def dataset(args, rows: int):
    import datasets
    if args.model is None:  # token ids, each row exactly --seq long
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(3, WORDS, (rows, args.seq), generator=g)
        return datasets.Dataset.from_dict({"input_ids": ids.tolist()})
    # text, each row longer than --seq tokens: truncated to --seq by SFT's max_length
    rng = random.Random(3)
    words = ("the a model memory step layer token batch train fused plan budget adapter "
             "gradient weight loss peak time device optimizer sequence kernel unit run").split()
    return datasets.Dataset.from_dict(
        {"text": [" ".join(rng.choice(words) for _ in range(2 * args.seq)) for _ in range(rows)]})


# ---- what is measured inside train() ------------------------------------------------------------

class StepMeter(TrainerCallback):
    """The peak tensor bytes of training step ``step`` (1-based) above those alive when it began:
    forward, backward, clipping, the optimizer's step, zero_grad. CPU: ckpt_ext's allocator meter,
    installed for that step alone; CUDA: ``torch.cuda.max_memory_allocated``."""

    def __init__(self, step: int, cuda: bool) -> None:
        self.step, self.cuda = step, cuda
        self.peak = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.before = torch.cuda.memory_allocated()
            else:
                self.meter = MemoryMeter("cpu")
                self.meter.start()
                self.before = self.meter.reset_peak()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            if self.cuda:
                torch.cuda.synchronize()
                self.peak = torch.cuda.max_memory_allocated() - self.before
            else:
                self.peak = self.meter.peak() - self.before
                self.meter.stop()
        return control


class StepTimer(TrainerCallback):
    """Wall time of each training step, on_step_begin to on_step_end (synchronized on CUDA)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.times = cuda, []

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = self._now()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(self._now() - self.t0)
        return control


# ---- one way ------------------------------------------------------------------------------------

def train(args, way: str, ckpt_callback, checkpointing: bool, out: str,
          measure: bool = True) -> dict:
    """One train() of ``way``; with ``measure``, the meter around the last step (its time left
    out), else every step after the first timed."""
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if (args.model and cuda) else torch.float32
    model = tiny_llama(args) if args.model is None else local_model(args, dtype)
    tokenizer = tiny_tokenizer() if args.model is None else _auto_tokenizer(args.model)
    extra = {} if checkpointing else {"activation_checkpointing": False}  # TRL's default: on
    config = SFTConfig(output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch,
                       max_length=args.seq, learning_rate=2e-4, logging_steps=1, report_to=[],
                       save_strategy="no", disable_tqdm=True, seed=0, data_seed=0,
                       use_cpu=not cuda, bf16=dtype == torch.bfloat16, **extra)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=args.lora_dropout,
                      task_type="CAUSAL_LM")
    meter, timer = StepMeter(args.steps if measure else 0, cuda), StepTimer(cuda)
    callbacks = [meter, timer] + ([ckpt_callback] if ckpt_callback is not None else [])
    torch.manual_seed(0)  # the adapters' initial values: the same in every way
    trainer = SFTTrainer(model=model, args=config, processing_class=tokenizer,
                         train_dataset=dataset(args, args.steps * args.batch), peft_config=lora,
                         callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # the per-step log lines; the table says it all
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # times: every step but the measured one, and but the first (warm-up) where others remain
    times = timer.times[:-1] if measure else timer.times
    times = times[1:] if len(times) > 1 else times
    row = dict(way=way, checkpointing=bool(trainer.args.activation_checkpointing),
               peak=meter.peak, times=times, loss=losses[-1], fused=None, unfused=None, predicted=None,
               plan=None)
    if ckpt_callback is not None:
        stats = ckpt_ext.stats(ckpt_callback._model)
        row.update(fused=stats.fused_calls, unfused=stats.unfused_calls)
        if ckpt_callback.plan is not None:
            row.update(predicted=ckpt_callback.plan.peak_bytes, plan=str(ckpt_callback.plan))
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def _auto_tokenizer(path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


# ---- the table ----------------------------------------------------------------------------------

def conditions(args, rows) -> str:
    cuda = torch.cuda.is_available()
    device = f"CUDA ({torch.cuda.get_device_name()})" if cuda else "CPU"
    dtype = "bfloat16" if (args.model and cuda) else "float32"
    model = (f"{args.model}" if args.model else
             f"tiny Llama (hidden {args.hidden}, MLP {args.inter}, {args.layers} layers, "
             f"{args.hidden // 64} heads, vocabulary {WORDS})")
    timed = (f"{len(rows[0]['times'])} steps: steps 2-{args.steps - 1} of the measured run"
             if args.steps > 2 else "step 1 of the measured run")
    if args.rounds:
        timed += (f" and steps 2-{args.steps} of {args.rounds} more train() per way, the ways "
                  f"in turn")
    meter = ("torch.cuda.max_memory_allocated" if cuda else
             "ckpt_ext's CPU allocator meter, exact tensor bytes")
    return (f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}, {dtype}; "
            f"{model}; TRL SFTTrainer with peft LoRA r=16 (alpha 32, dropout {args.lora_dropout}) "
            f"on {', '.join(TARGETS)}; {args.steps} steps of {args.batch}x{args.seq} tokens, "
            f"AdamW lr 2e-4. Peak: step {args.steps}, above the bytes alive when it began "
            f"(forward, backward, optimizer step), {meter}; time: median of {timed}, no meter "
            f"installed; loss: step {args.steps}'s.")


def table(rows) -> str:
    plain = next(r for r in rows if r["way"].startswith("(d)"))
    out = ["| way | checkpointing | peak of a step | step time | vs plain | final loss | "
           "fused / unfused calls | plan's predicted peak |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        r["time"] = statistics.median(r["times"])
    for r in rows:
        calls = "" if r["fused"] is None else f"{r['fused']} / {r['unfused']}"
        pred = "" if r["predicted"] is None else f"{r['predicted'] / MiB:,.1f} MiB"
        out.append(f"| {r['way']} | {'on' if r['checkpointing'] else 'off'} | "
                   f"{r['peak'] / MiB:,.1f} MiB | {r['time'] * 1e3:,.0f} ms | "
                   f"{r['time'] / plain['time']:.2f}x | {r['loss']:.4f} | {calls} | {pred} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a local checkpoint (AutoModelForCausalLM); default: a tiny "
                    "Llama built from a config")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--budget-mib", type=float, help="(c)'s budget; default: midway between "
                    "(b)'s and (a)'s measured peaks")
    ap.add_argument("--hidden", type=int, default=256, help="the tiny Llama's hidden size")
    ap.add_argument("--inter", type=int, default=704, help="the tiny Llama's MLP width")
    ap.add_argument("--layers", type=int, default=4, help="the tiny Llama's decoder layers")
    ap.add_argument("--lora-dropout", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=1, help="more train() per way for the times, "
                    "the ways in turn (a shared machine's load then falls on each alike)")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (one measured step, one timed)")
    warnings.filterwarnings("ignore", category=FutureWarning)
    import datasets
    import transformers
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as out:
        a = train(args, "(a) TRL's defaults", None, True, out)
        b = train(args, "(b) CkptExtCallback()", CkptExtCallback(), False, out)
        d = train(args, "(d) plain", None, False, out)
        budget = (int(args.budget_mib * MiB) if args.budget_mib is not None
                  else (a["peak"] + b["peak"]) // 2)
        c = train(args, f"(c) CkptExtCallback({budget / MiB:,.1f} MiB)",
                  CkptExtCallback(budget), False, out)
        rows = [a, b, c, d]
        ways = [(None, True), (CkptExtCallback, False),
                (lambda: CkptExtCallback(budget), False), (None, False)]
        for _ in range(args.rounds):
            for row, (make, checkpointing) in zip(rows, ways):
                cb = make() if make is not None else None
                row["times"] += train(args, row["way"], cb, checkpointing, out, False)["times"]
    print()
    print(conditions(args, rows))
    print()
    print(table(rows))
    print()
    print(c["plan"])


if __name__ == "__main__":
    main()
