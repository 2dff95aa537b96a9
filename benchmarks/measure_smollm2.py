"""Measure SmolLM2-135M-Instruct (packaged GGUF) offline: conversion, reload, KV retrieval, MMLU.

Usage: python benchmarks/measure_smollm2.py [--mmlu N] [--kv N]
"""

import argparse
import os
import tempfile
import time

import torch

from gna_lens.models import gguf, load_model
from gna_lens.tasks import evaluate, kv_retrieval, load_mmlu, multiple_choice


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mmlu", type=int, default=200, help="MMLU questions (every k-th record)")
    parser.add_argument("--kv", type=int, default=100, help="KV-retrieval prompts")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    path = gguf.packaged_gguf_path("smollm2-135m")
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        folder = gguf.convert_gguf(path, cache=cache)
        convert = time.perf_counter() - t0
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        AutoModelForCausalLM.from_pretrained(folder)
        reload = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in folder.iterdir()) / 1e6
        t0 = time.perf_counter()
        model = load_model(str(folder))
        boot = time.perf_counter() - t0
        print(
            f"conversion {convert:.1f}s, folder {size:.0f} MB, HF reload {reload:.1f}s, "
            f"bridge boot {boot:.1f}s",
            flush=True,
        )

        tok = model.tokenizer
        kv = kv_retrieval(tok, n_pairs=6, n_samples=args.kv, template="question", values="words")
        res = evaluate(model, kv, batch_size=16, progress=False)
        print(
            f"KV retrieval (question template, 6 word pairs, {len(kv)} prompts, choices): "
            f"{res.accuracy:.1%} (chance {res.chance:.1%})",
            flush=True,
        )

        records = load_mmlu()
        step = max(1, len(records) // args.mmlu)
        subset = records[::step][: args.mmlu]
        letter = multiple_choice(subset, tok, format="letter", duplicate_options="drop")
        res = evaluate(model, letter, batch_size=8, progress=False)
        print(
            f"MMLU letter format, zero-shot, {len(letter)} questions (every {step}th): "
            f"{res.accuracy:.1%} (chance {res.chance:.1%})",
            flush=True,
        )


if __name__ == "__main__":
    main()
