"""Why the raw ablation order's top heads of SmolLM2-135M are generic: the same four heads removed
by zero ablation (every position; every position but BOS) and by mean ablation, measured on
held-out KV prompts and on the shipped prose (evaluation half), with 95% intervals.

Usage: python benchmarks/generic_heads.py [--heads L1H3 L1H4 L18H6 L1H5] [--n 48]

The default heads are the four the scan ranked first before it had a control. Prints one line per
condition; the gotchas page quotes its output.
"""

import argparse

from gna_lens import load_model
from gna_lens.interventions import ablation_sweep, control_sweep
from gna_lens.stats import bootstrap_interval, wilson_interval
from gna_lens.tasks import kv_retrieval, text_control


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", nargs="*", default=["L1H3", "L1H4", "L18H6", "L1H5"])
    parser.add_argument("--n", type=int, default=48, help="held-out KV prompts")
    args = parser.parse_args()
    heads = [(int(h[1 : h.index("H")]), int(h[h.index("H") + 1 :])) for h in args.heads]
    model = load_model("smollm2-135m")
    tok = model.tokenizer
    kw = dict(n_pairs=6, template="question", values="words")
    held = kv_retrieval(tok, n_samples=args.n, seed=1, **kw)  # type: ignore[arg-type]
    # One prompt length, so that "every position but BOS" is one list of positions.
    lengths = [s.n_tokens for s in held]
    length = max(set(lengths), key=lengths.count)
    held = held[:0].__class__(
        samples=tuple(s for s in held if s.n_tokens == length), name=held.name,
        scoring=held.scoring, pad_token_id=held.pad_token_id, info=held.info, tokenizer=tok,
    )  # fmt: skip
    reference = kv_retrieval(tok, n_samples=32, seed=7, **kw)  # type: ignore[arg-type]
    prose = text_control(tok, split="eval")
    conditions = {
        "zero, every position": dict(mode="zero", positions=None),
        "zero, every position but BOS": dict(mode="zero", positions=list(range(1, length))),
        "mean over other KV prompts, every position": dict(
            mode="mean", positions=None, reference=reference
        ),
    }
    print(
        f"heads {' '.join(args.heads)}; KV: {len(held)} held-out prompts; control: {prose.describe()}"
    )
    for name, kw_ in conditions.items():
        acc = ablation_sweep(model, held, "accuracy", [heads], progress=False, **kw_)  # type: ignore[arg-type]
        ctrl_kw = {k: v for k, v in kw_.items() if k != "reference"}
        if ctrl_kw.get("positions") is not None:
            ctrl_kw["positions"] = list(range(1, prose.seq_len - 1))  # inputs: seq_len - 1 tokens
        loss = control_sweep(model, prose, [heads], progress=False, **ctrl_kw)  # type: ignore[arg-type]
        before = wilson_interval(float(acc.baseline.sum()), len(held))
        after = wilson_interval(float(acc.values[0].sum()), len(held))
        change = bootstrap_interval((loss.values[0] - loss.baseline).double())
        print(
            f"{name}: KV {before.format(percent=True)} -> {after.format(percent=True)}; prose "
            f"{loss.baseline_mean:.3f} nats/token, change {change.format(signed=True)}"  # type: ignore[union-attr]
        )


if __name__ == "__main__":
    main()
