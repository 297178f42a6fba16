"""Shared by the generation-engine tests (test_vllm_*, test_dsinfer_*): a trained tiny model and
the Hugging Face answers the engines are checked against.

A freshly initialised tiny model has near-flat next-token distributions: greedy decoding then
hinges on logit gaps of 1e-5, where two correct implementations may differ. `trained_tiny_model`
trains it a few steps with a high learning rate on a fixed token pattern, so its predictions are
peaked; `min_top2_gap` measures the margin the greedy comparisons rely on.
"""
from __future__ import annotations

from pathlib import Path

import torch

from xray.backends.base import OptimConfig
from xray.check.reference import load_hf, policy_loss, reference_train_step
from xray.data import columns as C
from xray.data.batch import Batch
from xray.builtin.tiny_llama import TinySpec, build_tiny_model

SPEC = TinySpec()  # head_dim = 128 / 4 = 32, the smallest vLLM's CPU attention accepts
EOS = 2


def pattern_batch(rows: int, seq_len: int, vocab: int, seed: int) -> Batch:
    """Sequences that follow t -> (5 t + 3) mod vocab, away from the special ids 0..2."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(3, vocab, (rows, 1), generator=g)
    ids = [start]
    for _ in range(seq_len - 1):
        ids.append((5 * ids[-1] + 3) % (vocab - 3) + 3)
    ids = torch.cat(ids, dim=1)
    mask = torch.ones_like(ids)
    return Batch({C.INPUT_IDS: ids, C.ATTENTION_MASK: mask,
                  C.LOSS_MASK: torch.ones(rows, seq_len - 1)})


def train_in_place(model: torch.nn.Module, steps: int, seed: int, lr: float = 1e-2) -> None:
    batch = pattern_batch(32, 24, model.config.vocab_size, seed)
    reference_train_step(model, batch, policy_loss, OptimConfig(lr=lr, grad_clip=1.0),
                         micro_batch_size=32, steps=steps)


def trained_tiny_model(directory: str | Path, steps: int = 30, seed: int = 0) -> Path:
    """Build the tiny model, train it `steps` steps on the pattern, save it; return the path."""
    directory = build_tiny_model(directory, SPEC, seed=seed)
    torch.manual_seed(seed)
    model = load_hf(str(directory))
    train_in_place(model, steps, seed)
    model.save_pretrained(directory, safe_serialization=True)
    return Path(directory)


def changed_weights(model: torch.nn.Module, steps: int = 15, seed: int = 1) -> list[tuple[str, torch.Tensor]]:
    """Train `model` further on another pattern start (in place) and return its new weights."""
    train_in_place(model, steps, seed, lr=2e-2)
    return [(k, v.detach().clone()) for k, v in model.state_dict().items()]


def make_prompts(count: int, seed: int = 123, vocab: int = SPEC.vocab_size) -> list[list[int]]:
    """`count` prompts of 3..10 random tokens (ids >= 3, so no eos inside a prompt)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 11, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face greedy responses (eos included when reached), one prompt at a time."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=EOS, pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


@torch.no_grad()
def hf_sequence_stats(model: torch.nn.Module, sequences: list[list[int]],
                      prompt_lens: list[int]) -> tuple[list[list[float]], float]:
    """Per-token log-probs after each prompt, and the smallest top-1 minus top-2 logit gap at
    the positions that predict those tokens."""
    logprobs, gap = [], float("inf")
    for seq, plen in zip(sequences, prompt_lens):
        logits = model(torch.tensor([seq])).logits[0].float()  # [T, V]
        pred = logits[plen - 1:len(seq) - 1]
        top2 = pred.topk(2, dim=-1).values
        if len(pred):
            gap = min(gap, float((top2[:, 0] - top2[:, 1]).min()))
        lp = torch.log_softmax(pred, dim=-1).gather(-1, torch.tensor(seq[plen:]).unsqueeze(-1))
        logprobs.append(lp.squeeze(-1).tolist())
    return logprobs, gap


def sequences_of(batch: Batch) -> tuple[list[list[int]], list[int]]:
    """Prompt + response token lists of a generation Batch, and the prompt lengths."""
    seqs = [p + r for p, r in zip(batch[C.PROMPT_IDS], batch[C.RESPONSE_IDS])]
    return seqs, [len(p) for p in batch[C.PROMPT_IDS]]


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b], "sequences of different lengths"
    return max((abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)), default=0.0)


SYMBOL_BASE = 0x4E00  # id i is the one character chr(SYMBOL_BASE + i)


def save_symbol_tokenizer(directory: str | Path, vocab: int = SPEC.vocab_size) -> None:
    """A tokenizer for the tiny model: one character per id, no special tokens (no EOS), so that a
    stop string names the token that completes it exactly (`symbols`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({chr(SYMBOL_BASE + i): i for i in range(vocab)}, unk_token=chr(SYMBOL_BASE)))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=core).save_pretrained(str(directory))


def symbols(ids: list[int]) -> str:
    """The text of `ids` under `save_symbol_tokenizer`'s tokenizer."""
    return "".join(chr(SYMBOL_BASE + i) for i in ids)


def stop_string_case(greedy: list[int]) -> tuple[str, int]:
    """A stop string of a greedy response (its 6th and 7th tokens' text) and how many tokens the
    response keeps: up to the first token whose text completes it."""
    stop = symbols(greedy[5:7])
    return stop, next(k for k in range(1, len(greedy) + 1) if stop in symbols(greedy[:k]))
