"""How close ``gna-lens scan --dry-run`` comes to the scan it estimates (issue 40).

For each model: :func:`gna_lens.scan.estimate_scan` (one timed forward, the work counted per
stage), then the scan itself with the same arguments in the same process; prints the estimate,
the measured seconds per stage and their ratio. ``--dry-run-only NAME`` adds models that are only
estimated (e.g. a random model with Llama-3.2-1B's config: ``llama-1b-shaped``).

    python benchmarks/bench_dry_run.py                      # zoo-mamba2, smollm2-135m (small)
    python benchmarks/bench_dry_run.py --dry-run-only llama-1b-shaped
"""

import argparse
import json
import platform
import time

import torch

from gna_lens import zoo
from gna_lens.runtime import cpu_description
from gna_lens.scan import build_tasks, estimate_scan, load_scan_model, scan

#: Stages of the estimate, and the scan timings they are compared with.
STAGES = {
    "baseline_check": ("baseline_check",),
    "pattern_scores": ("pattern_scores",),
    "layers": ("layer_sweep",),
    "attribution": ("attribution",),
    "ablation": ("ablation_sweep",),
    "control": ("control_sweep",),
    "joint_control": ("joint_control",),
    "held_out": ("held_out",),
}


def _llama_1b_shaped() -> object:
    """Random weights with Llama-3.2-1B's config (16 layers, d_model 2048, 32 heads, 8 KV heads,
    MLP 8192, tied embeddings), SmolLM2's tokenizer (Llama-3's is gated): 1.1 B parameters."""
    import tempfile

    from transformers import AutoTokenizer

    from gna_lens.models import gguf, load_model
    from gna_lens.testing import tiny_hf_model

    tok = AutoTokenizer.from_pretrained(gguf.convert_gguf(gguf.packaged_gguf_path("smollm2-135m")))
    folder = tempfile.mkdtemp(prefix="llama-1b-shaped-")
    shape = dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, tie_word_embeddings=True, rope_theta=500000.0,
    )  # fmt: skip
    tiny_hf_model("llama", vocab_size=len(tok), **shape).save_pretrained(folder)
    tok.save_pretrained(folder)
    return load_model(folder)


def _kwargs(model: object, name: str, n_samples: int, n_eval: int, draws: int) -> dict:
    if name.startswith("zoo-"):
        sets = zoo.scan_tasks(model.tokenizer, "kv", n_samples=n_samples, n_eval=n_eval)
    else:
        sets = build_tasks(model.tokenizer, "kv", n_samples, 0, n_eval=n_eval)
    return dict(tasks=sets, random_draws=draws, top=4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="zoo-mamba2,smollm2-135m")
    parser.add_argument("--dry-run-only", default="", help="models only estimated")
    parser.add_argument("--n-samples", type=int, default=16)
    parser.add_argument("--n-eval", type=int, default=24)
    parser.add_argument("--random-draws", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file of the results")
    args = parser.parse_args(argv)
    results = []
    names = [m for m in args.models.split(",") if m]
    only = [m for m in args.dry_run_only.split(",") if m]
    for name in names + only:
        t0 = time.perf_counter()
        model = _llama_1b_shaped() if name == "llama-1b-shaped" else load_scan_model(name)
        load_s = time.perf_counter() - t0
        kw = _kwargs(model, name, args.n_samples, args.n_eval, args.random_draws)
        t0 = time.perf_counter()
        est = estimate_scan(model, **kw)
        est_s = time.perf_counter() - t0
        row = {"model": name, "load_s": load_s, "dry_run_s": est_s, "estimate_s": est.seconds,
               "strategy": est.strategy, "n_exact": est.n_exact,
               "estimate": {k: v * est.per_row_s for k, v in est.rows.items()}}  # fmt: skip
        print(f"== {name}: loaded in {load_s:.1f} s; dry run {est_s:.1f} s")
        print("\n".join(est.format_lines()))
        if name in names:
            result = scan(model, out=None, progress=False, force=True, **kw)
            timings = dict(result.timings) | dict(result.report.timings)
            measured = {
                stage: sum(timings.get(t, 0.0) for t in keys)
                for stage, keys in STAGES.items()
                if stage in est.rows
            }
            row["measured"] = measured
            row["measured_s"] = result.seconds - timings.get("tasks", 0.0)
            row["ratio"] = row["measured_s"] / est.seconds
            for stage, secs in measured.items():
                guess = est.rows[stage] * est.per_row_s
                print(f"  {stage}: estimated {guess:.1f} s, measured {secs:.1f} s")
            print(
                f"  total (stages): estimated {est.seconds:.1f} s, measured "
                f"{row['measured_s']:.1f} s: measured / estimated = {row['ratio']:.2f}"
            )
        results.append(row)
        del model
    machine = f"{cpu_description()}, {torch.get_num_threads()} torch thread(s), {platform.python_version()}"
    print(f"Machine: {machine}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
