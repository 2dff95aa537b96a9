"""Shared builders for the tests of gna_lens.tasks: tiny tokenizers and a tiny random Llama."""

import functools
import random

import torch

from gna_lens.tasks import load_words
from gna_lens.tasks.toy_tokenizers import (
    byte_level_bpe_tokenizer,
    metaspace_bpe_tokenizer,
    newline_merging_bpe_tokenizer,
    word_tokenizer,
)

KEYS = tuple(load_words()[:60])
MC_RECORDS = (
    ("Which planet is largest?", ["Mars", "Jupiter", "Venus", "Earth"], 1, "astronomy"),
    (
        "What is the boiling point of water at sea level?",
        ["50 C", "100 C", "150 C", "0 C"],
        1,
        "physics",
    ),
    (
        "Which gas do plants absorb?",
        ["oxygen", "nitrogen", "carbon dioxide", "helium"],
        2,
        "biology",
    ),
    ("Which star is closest to Earth?", ["Sirius", "Vega", "Proxima", "the Sun"], 3, "astronomy"),
    ("What is the unit of force?", ["newton", "joule", "watt", "pascal"], 0, "physics"),
    ("Which organ pumps blood?", ["liver", "lung", "heart", "kidney"], 2, "biology"),
    ("Which planet has rings?", ["Saturn", "Mercury", "Mars", "Venus"], 0, "astronomy"),
    ("What is the speed of light?", ["3e8 m/s", "3e5 m/s", "300 m/s", "3 m/s"], 0, "physics"),
)


@functools.cache
def corpus() -> tuple[str, ...]:
    """KV prompts in both templates plus MC questions: what the tiny tokenizers are trained on."""
    rng = random.Random(0)
    out = []
    for _ in range(200):
        ks = rng.sample(KEYS, 8)
        vs = rng.sample(range(100), 8)
        out.append(
            "Memorize the following dictionary:\n"
            + "".join(f"{k}:{v}\n" for k, v in zip(ks, vs, strict=True))
            + f"The value of the key '{ks[0]}' is {vs[0]}"
        )
        out.append(
            "Below is a list of key-value pairs.\n"
            + "".join(f"{k}: {v}\n" for k, v in zip(ks, vs, strict=True))
            + f"What is the value for key {ks[0]}?\n{ks[0]}: {vs[0]}"
        )
    for q, opts, a, subj in MC_RECORDS:
        block = q + "\n" + "".join(f"{L}. {o}\n" for L, o in zip("ABCD", opts, strict=True))
        for _ in range(5):
            out.append(
                f"The following are multiple choice questions (with answers) about {subj}.\n\n"
                + block
                + f"Answer: {'ABCD'[a]}\n\n"
                + block
                + f"Answer: {opts[a]}\n\n"
            )
    return tuple(out)


@functools.cache
def tokenizer(kind: str, bos: bool):
    """One of the tiny tokenizers, with or without a BOS token."""
    if kind == "word":
        return word_tokenizer(list(corpus()), bos=bos)
    if kind == "byte_bpe":
        return byte_level_bpe_tokenizer(corpus(), vocab_size=1000, bos=bos)
    if kind == "newline_bpe":
        return newline_merging_bpe_tokenizer(corpus(), vocab_size=900, bos=bos)
    if kind == "metaspace_bpe":
        return metaspace_bpe_tokenizer(corpus(), vocab_size=1200, bos=bos)
    raise ValueError(kind)


class LogitsModel(torch.nn.Module):
    """A HF causal LM called the way gna_lens calls models: ``model(ids, attention_mask=...)``."""

    def __init__(self, hf_model, tokenizer):
        super().__init__()
        self.hf = hf_model
        self.tokenizer = tokenizer
        self.config = hf_model.config

    def forward(self, input_ids, attention_mask=None):
        return self.hf(input_ids=input_ids, attention_mask=attention_mask).logits


def tiny_llama(tok, *, n_ctx: int = 512, seed: int = 0) -> LogitsModel:
    """A 2-layer random LlamaForCausalLM over ``tok``'s vocabulary, built in code."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=n_ctx,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    # Sharpen the random model so that choices get clearly different scores.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return LogitsModel(model, tok).eval()
