"""The scan's cost and the shortcuts it may take, on SmolLM2-135M (the demo's setting).

Measured in one run, on the demo's 16 selection prompts (KV retrieval, question template, 6 word
pairs) and its prose control (8 windows of 48 tokens):

1. every one of the 270 heads ablated exactly, on the task and on the control, in float32 and
   under bfloat16 autocast: wall time of each, and how far the bfloat16 effects are from the
   float32 ones (max |difference|, Spearman correlation, overlap of the top 10);
2. the attribution prefilter: its time, and its recall of the exact top 10 (raw ablation order,
   and the retrieval-specific order) within the heads it would ablate exactly, for prefilters of
   16, 32 and 64 heads.

Prints a markdown table for benchmarks/RESULTS.md. Takes ~12 min on 2 idle cores.

Usage: python benchmarks/bench_scan.py [--threads 2]
"""

import argparse
import platform
import time

import torch

from gna_lens import load_model, score_heads
from gna_lens.findings.experiments import smollm2_label
from gna_lens.interventions import attribute_heads
from gna_lens.stats import spearman
from gna_lens.tasks import kv_retrieval, text_control


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-samples", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("smollm2-135m")
    tok = model.tokenizer
    task = kv_retrieval(
        tok, n_pairs=6, n_samples=args.n_samples, seed=0, template="question", values="words"
    )
    control = text_control(tok, split="select")
    reports, seconds = {}, {}
    for dtype in ("bfloat16", "float32"):
        t0 = time.perf_counter()
        reports[dtype] = score_heads(
            model, task, control=control, sweep_dtype=dtype, n_examples=0, progress=False
        )
        seconds[dtype] = time.perf_counter() - t0
    exact, fast = reports["float32"], reports["bfloat16"]
    a, b = exact.scores["ablation_effect"], fast.scores["ablation_effect"]
    ca, cb = exact.scores["control_effect"], fast.scores["control_effect"]
    t0 = time.perf_counter()
    est = attribute_heads(model, task, metric="logit_diff")
    t_attr = time.perf_counter() - t0
    by_head = {c[0]: e for c, e in zip(est.cells, est.effects.tolist(), strict=True)}
    order = sorted(exact.heads, key=lambda h: by_head[h])
    raw10, spec10 = set(exact.top(10, by="ablation_effect")), set(exact.top(10))

    print(f"{smollm2_label(model)}, {len(task)} prompts, {control.describe()}")
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}\n"
    )
    print("| measurement | value |")
    print("|---|---|")
    print(f"| all 270 heads exact, task + control, float32 | {seconds['float32']:.0f} s |")
    print(
        f"| same under bfloat16 autocast | {seconds['bfloat16']:.0f} s "
        f"({seconds['float32'] / seconds['bfloat16']:.2f}x faster) |"
    )
    print(
        f"| bfloat16 vs float32: ablation effects | max abs diff {(a - b).abs().max():.3f} logits "
        f"(effects span {a.min():.2f} to {a.max():.2f}); Spearman {spearman(a, b):.4f} |"
    )
    print(
        f"| bfloat16 vs float32: control effects | max abs diff {(ca - cb).abs().max():.4f} "
        f"nats/token; Spearman {spearman(ca, cb):.4f} |"
    )
    print(
        f"| bfloat16 vs float32: top 10 | raw order {len(set(fast.top(10, by='ablation_effect')) & raw10)}"
        f"/10 shared; retrieval-specific {len(set(fast.top(10)) & spec10)}/10 shared |"
    )
    print(f"| attribution over all 270 heads | {t_attr:.1f} s |")
    for n in (16, 32, 64):
        pre = set(order[:n])
        print(
            f"| prefilter {n}: recall of the exact top 10 | raw order {len(pre & raw10)}/10, "
            f"retrieval-specific {len(pre & spec10)}/10 |"
        )
    print(f"\nexact top 10 (retrieval-specific): {sorted(spec10)}")
    print(f"exact top 10 (raw): {sorted(raw10)}")


if __name__ == "__main__":
    main()
