"""swap_heads on zoo-mamba2: its top-ranked retrieval head vs random heads swapped for attention.

The top head is ranked by ``score_heads`` on the zoo's KV selection prompts (the first
``--n-rank`` of its kv-8 split, the cloze select half as the control, the default
retrieval-specific ranking). Each swap trains only the new attention head's parameters with the
same budget, data (the default distillation data: the zoo tokenizer's KV texts, seeds in
``DISTILL_SEEDS``) and seed; every model is then measured on the zoo's held-out kv-16 split (200
prompts, seed 10016; never selection or training data), kv-8 after the selection prompts, and the
cloze eval half, with 95% Wilson intervals.

    OMP_NUM_THREADS=1 python benchmarks/bench_hybrid_swap.py --budget "300k tokens" --random 4 \\
        --out docs/assets/hybrid_swap_zoo.json
"""

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="300k tokens")
    parser.add_argument(
        "--random", type=int, default=4, help="random heads swapped (one model each)"
    )
    parser.add_argument("--n-rank", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default="hybrid_swap_zoo.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from gna_lens import score_heads, zoo
    from gna_lens.hybrid import default_distill_data, swap_heads
    from gna_lens.stats import wilson_interval
    from gna_lens.tasks import evaluate

    t_all = time.perf_counter()
    model = zoo.load("zoo-mamba2")
    tok = model.tokenizer
    splits = zoo.tasks(tok)
    selection = splits["kv-8"][: args.n_rank]
    held = {
        "kv-16": splits["kv-16"],
        "kv-8": splits["kv-8"][args.n_rank :],
        "cloze": zoo.control(tok, "eval"),
    }
    t0 = time.perf_counter()
    report = score_heads(model, selection, control=zoo.control(tok, "select"), progress=False)
    rank_s = time.perf_counter() - t0
    ranking = report.top(8)
    top = tuple(ranking[0])
    every = [(a, b) for a in range(model.cfg.n_layers) for b in range(model.cfg.n_heads)]
    rng = random.Random(f"swap-random/{args.seed}")
    randoms = rng.sample([h for h in every if h != top], args.random)
    data = default_distill_data(tok, args.seed)

    correct: dict[str, torch.Tensor] = {}

    def measure(m, name: str) -> dict:
        out = {}
        for task_name, task in held.items():
            res = evaluate(m, task, batch_size=50, progress=False)
            out[task_name] = wilson_interval(float(res.correct.sum()), len(res)).to_dict()
            if task_name == "kv-16":
                correct[name] = res.correct.float()
        return out

    rows = [
        {"name": "zoo-mamba2 (no swap)", "head": None, **measure(model, "none"), "seconds": 0.0}
    ]
    plan = [("top (untrained)", top, 1)]
    plan += [("top", top, args.budget)] + [
        (f"random {i + 1}", h, args.budget) for i, h in enumerate(randoms)
    ]
    for name, head, budget in plan:
        t0 = time.perf_counter()
        swapped = swap_heads(
            model, [head], train_data=data, budget=budget, seed=args.seed, lr=args.lr,
            progress=False,
        )  # fmt: skip
        train_s = time.perf_counter() - t0
        res = swapped.gna_swap_result
        row = {
            "name": name,
            "head": list(head),
            **measure(swapped, name),
            "train_tokens": res.totals.get("swap", {}).get("tokens"),
            "train_seconds": round(train_s, 1),
            "loss_before_after": res.probe.get("swap"),
        }
        rows.append(row)
        print(
            f"{name} L{head[0]}H{head[1]}: kv-16 {row['kv-16']['value']:.3f} "
            f"[{row['kv-16']['low']:.3f}, {row['kv-16']['high']:.3f}] ({train_s:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    from gna_lens.stats import bootstrap_interval

    paired = {
        other: bootstrap_interval(correct["top"] - correct[other]).to_dict()  # type: ignore[union-attr]
        for other in correct
        if other not in ("top", "top (untrained)")
    }
    # Against "a random head": per prompt, the top swap's 0 / 1 minus the mean over the random
    # swaps (the same prompts), one paired bootstrap interval.
    random_names = [f"random {i + 1}" for i in range(len(randoms))]
    if random_names:
        mean_random = torch.stack([correct[n] for n in random_names]).mean(0)
        paired["mean of the random swaps"] = bootstrap_interval(
            correct["top"] - mean_random
        ).to_dict()  # type: ignore[union-attr]
    result = {
        "model": "zoo-mamba2",
        "paired_kv16": {
            "what": "top swap minus each other model, per kv-16 prompt (same 200 prompts), mean "
            "with a 95% paired bootstrap interval",
            **paired,
        },
        "ranking": {
            "criterion": report.criterion,
            "top8": [list(h) for h in ranking],
            "selection": f"first {args.n_rank} prompts of the zoo's kv-8 split; control: cloze select half",
            "seconds": round(rank_s, 1),
        },
        "swap": {
            "budget": args.budget,
            "lr": args.lr,
            "seed": args.seed,
            "data": data.describe(),
            "trained": "only the new attention head's attn_proj and attn_conv",
            "random_heads": f"{args.random} heads drawn uniformly from the other 31 (random.Random('swap-random/{args.seed}'))",
        },
        "held_out": "zoo kv-16 (200 prompts, seed 10016), kv-8 after the selection prompts, cloze eval half; 95% Wilson intervals",
        "rows": rows,
        "kv16_correct": {name: [int(x) for x in c.tolist()] for name, c in correct.items()},
        "machine": f"{platform.machine()}, 1 torch thread, torch {torch.__version__}",
        "wall_seconds": round(time.perf_counter() - t_all, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for r in rows:
        cells = " | ".join(
            f"{100 * r[t]['value']:.1f}% [{100 * r[t]['low']:.1f}, {100 * r[t]['high']:.1f}]"
            for t in held
        )
        head = "-" if r["head"] is None else f"L{r['head'][0]}H{r['head'][1]}"
        print(f"| {r['name']} | {head} | {cells} |")
    for other, iv in paired.items():
        print(
            f"top - {other} (kv-16, paired): {100 * iv['value']:+.1f} [{100 * iv['low']:+.1f}, {100 * iv['high']:+.1f}] points"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
