"""What ``sweep_dtype="auto"`` measures and chooses, on this CPU and with bfloat16 forced slow.

One run, two processes side by side on the same machine:

1. **as the CPU is**: torch's own kernels;
2. **bfloat16 forced slow**: the same process with oneDNN capped at AVX2
   (``ONEDNN_MAX_CPU_ISA=AVX2``), so its bfloat16 matmuls run without AVX512-BF16, as on an
   AVX2-only CPU (float32 matmuls go through MKL and keep their speed).

In each: a one-thread 64 x 576 by 576 x 1536 matmul (SmolLM2-135M's MLP width; the shape issue 28
timed on an AVX2-only AMD EPYC: 1.9 ms float32, 20.1 ms bfloat16) in both dtypes, then the probe
of :func:`gna_lens.sweep_policy.resolve_sweep_dtype` on SmolLM2-135M and the demo's 16 selection
prompts, with the model counted as large (``EXACT_ALL_MAX`` set to 0 for this benchmark; at its
270 heads the scan keeps float32 without probing). With ``BENCH_PRECISION_SWEEP=1`` each process
also runs the exact ablation sweep of 18 heads (layers 10 and 20) on the 16 prompts in float32
and in bfloat16, interleaved twice: does the probe point the way the sweep goes? Prints the
choice each made and what it measured, as JSON and as a markdown table for
benchmarks/RESULTS.md. About 1 minute (4 with the sweep).

Usage: python benchmarks/bench_precision.py [--threads 2]
"""

import argparse
import json
import os
import subprocess
import sys
import time


def _matmul_ms() -> dict[str, float]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(64, 576), torch.randn(576, 1536)
    out = {}
    for name, x, y, n in (("float32", a, b, 200), ("bfloat16", a.bfloat16(), b.bfloat16(), 30)):
        for _ in range(5):
            x @ y
        t0 = time.perf_counter()
        for _ in range(n):
            x @ y
        out[name] = (time.perf_counter() - t0) / n * 1e3
    torch.set_num_threads(before)
    return out


def _child(threads: int) -> dict:
    import torch

    import gna_lens.sweep_policy as report
    from gna_lens import load_model
    from gna_lens.runtime import cpu_description
    from gna_lens.tasks import kv_retrieval

    torch.set_num_threads(threads)
    mm = _matmul_ms()
    model = load_model("smollm2-135m")
    task = kv_retrieval(
        model.tokenizer, n_pairs=6, n_samples=16, seed=0, template="question", values="words"
    )
    report.EXACT_ALL_MAX = 0  # count SmolLM2's 270 heads as large: the probe runs
    t0 = time.perf_counter()
    dtype, record = report.resolve_sweep_dtype(model, "auto", task)
    sweep = {}
    if os.environ.get("BENCH_PRECISION_SWEEP"):  # the sweep itself, both ways, interleaved
        from gna_lens.interventions import ablation_sweep

        heads = [(10, h) for h in range(9)] + [(20, h) for h in range(9)]
        for dt in ("float32", "bfloat16", "float32", "bfloat16"):
            with report.sweep_precision(model, dt):
                t1 = time.perf_counter()
                ablation_sweep(model, task, heads=heads, progress=False)
                sweep.setdefault(dt, []).append(time.perf_counter() - t1)
    return {
        "sweep_18_heads_seconds": sweep,
        "machine": cpu_description(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "(torch's default)"),
        "torch_threads": threads,
        "matmul_ms_one_thread": mm,
        "choice": dtype or "float32",
        "why": record["sweep_dtype_choice"],
        "probe": record.get("sweep_dtype_probe"),
        "choice_seconds": time.perf_counter() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.threads)))
        return
    runs = {}
    for label, extra in (
        ("as the CPU is", {}),
        ("bfloat16 forced slow", {"ONEDNN_MAX_CPU_ISA": "AVX2"}),
    ):
        env = os.environ | extra
        cmd = [sys.executable, __file__, "--child", "--threads", str(args.threads)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        runs[label] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(runs, indent=1))
    first = next(iter(runs.values()))
    print(f"\n{first['machine']}; {args.threads} torch threads for the probe\n")
    print("| setting | matmul fp32 / bf16 (1 thread) | probe: fp32 / bf16 per run | choice |")
    print("|---|---|---|---|")
    for label, r in runs.items():
        mm, p = r["matmul_ms_one_thread"], r["probe"]
        print(
            f"| {label} (oneDNN ISA {r['onednn_max_cpu_isa']}) | {mm['float32']:.2f} / "
            f"{mm['bfloat16']:.2f} ms | {p['float32_seconds'] * 1e3:.0f} / "
            f"{p['bfloat16_seconds'] * 1e3:.0f} ms ({p['speedup']:.2f}x) | {r['choice']} |"
        )
    for label, r in runs.items():
        print(f"\n{label}: {r['why']}")


if __name__ == "__main__":
    main()
