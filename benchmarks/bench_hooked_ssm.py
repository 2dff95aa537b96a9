"""HookedSSM benchmarks, measured side by side in one run (interleaved repeats, median ratios).

1. Fast-path forward vs Hugging Face transformers' forward on the same weights (batch 8 x 256),
   for every family HookedSSM loads, with the largest logit difference.
2. Materialized path (every SSM layer's ``hook_pattern`` hooked) vs fast path: L = 1024 for every
   Mamba-2 family (and 256 for Mamba-2); Mamba-1 at 256 and 1024, all channels and 16 of them.
3. Peak memory of materializing one layer's pattern for one query row vs all rows, L up to 4096
   (each measurement in a fresh subprocess: peak RSS (VmHWM, reset after a fast-path warm-up)
   above the RSS at that point).
4. Pattern budget (``gna_lens.models.kernels.pattern_budget``): peak memory and time of a forward
   (and, with gradients, its backward) with every layer's pattern materialized, budget large vs
   small, next to the fast path, on a mamba2-130m-like configuration (d_model 768, 24 heads x 64,
   d_state 128, chunk 256; 4 layers). Each run in a fresh subprocess; on the CPU glibc is told to
   map every allocation above 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so that the peak RSS follows the
   live tensors; on CUDA, ``torch.cuda.max_memory_allocated`` above what was allocated before. The
   path each mixer took (``kernel_paths``) is printed with it.

Run: ``python benchmarks/bench_hooked_ssm.py [--quick] [--archs mamba2,zamba2] [--no-memory]``;
prints the model sizes and Markdown tables. ``--pattern-memory [--device cuda] [--batch 8]`` runs
table 4 alone.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from gna_lens.models import HookedSSM
from gna_lens.models.kernels import kernel_paths, pattern_budget
from gna_lens.testing import tiny_hf_model, tiny_tokenizer

# A small but not toy configuration per family (d_model 256, 4-6 layers, about 1-8 M parameters;
# SSM heads of 64 channels, d_state 64 and chunks of 128 for the Mamba-2 families, d_state 16 for
# Mamba-1; layer mixes after the real checkpoints' patterns, scaled down). ``describe`` prints them.
_MAMBA2_SSM = dict(mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64,
                   mamba_chunk_size=128)  # fmt: skip
CONFIGS: dict[str, dict] = {
    "mamba1": dict(hidden_size=256, num_hidden_layers=4, state_size=16, time_step_rank=16),
    "falcon_mamba": dict(hidden_size=256, num_hidden_layers=4, state_size=16, time_step_rank=16),
    "mamba2": dict(
        hidden_size=256,
        num_hidden_layers=4,
        state_size=64,
        num_heads=8,
        head_dim=64,
        n_groups=1,
        chunk_size=128,
    ),
    "bamba": dict(
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=512,
        attn_layer_indices=[2],
        num_attention_heads=8,
        num_key_value_heads=4,
        **_MAMBA2_SSM,
    ),
    # Nemotron-H-8B's pattern (Mamba-2 / MLP pairs, one attention layer), scaled down.
    "nemotron_h": dict(
        hidden_size=256,
        layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba", "mlp"],
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        mamba_num_heads=8,
        mamba_head_dim=64,
        n_groups=1,
        ssm_state_size=64,
        chunk_size=128,
    ),
    # Granite 4.0 H: Mamba-2 layers, one attention layer, a shared MLP and routed experts in
    # every layer.
    "granitemoehybrid": dict(
        hidden_size=256,
        num_hidden_layers=4,
        layer_types=["mamba", "mamba", "attention", "mamba"],
        intermediate_size=128,
        shared_intermediate_size=512,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        **_MAMBA2_SSM,
    ),
    # Falcon-H1: attention beside the Mamba-2 mixer in every layer.
    "falcon_h1": dict(
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        mamba_d_ssm=512,
        **_MAMBA2_SSM,
    ),
    # Jamba: Mamba-1 layers, attention in one layer of four, MoE in every second layer.
    "jamba": dict(
        hidden_size=256,
        num_hidden_layers=4,
        attn_layer_period=4,
        attn_layer_offset=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=8,
        num_experts_per_tok=2,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=4,
        mamba_d_state=16,
        mamba_dt_rank=16,
    ),
    # Zamba2: Mamba-2 layers, two hybrid layers invoking the two shared transformer blocks.
    "zamba2": dict(
        hidden_size=256,
        num_hidden_layers=6,
        layers_block_type=["mamba", "mamba", "hybrid", "mamba", "mamba", "hybrid"],
        num_mem_blocks=2,
        adapter_rank=32,
        intermediate_size=1024,
        num_attention_heads=8,
        n_mamba_heads=8,
        mamba_ngroups=1,
        mamba_d_state=64,
        chunk_size=128,
    ),
}
#: The families with Mamba-2 mixers (the materialized-path goal applies to them).
MAMBA2_FAMILIES = ("mamba2", "bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba2")


def _pair(arch: str) -> tuple[torch.nn.Module, HookedSSM]:
    hf = tiny_hf_model(arch, seed=0, **CONFIGS[arch])
    return hf, HookedSSM.from_hf_model(hf, tiny_tokenizer())


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def describe(archs: list[str]) -> list[str]:
    """One Markdown row per family: its layers, sizes and parameter count."""
    rows = []
    for arch in archs:
        hf, model = _pair(arch)
        cfg = model.cfg
        kinds = ", ".join(f"{n} {k}" for k, n in _counts(cfg.layer_types).items())
        if arch in ("mamba1", "falcon_mamba", "jamba"):
            ssm = f"{cfg.d_inner} channels, d_state {cfg.d_state}"
        else:
            ssm = f"{cfg.n_heads} heads x {cfg.d_head}, d_state {cfg.d_state}"
            ssm += f", chunk {cfg.chunk_size}"
        attn = (
            f"{cfg.n_attn_heads} heads x {cfg.attn_d_head} ({cfg.n_attn_kv_heads} kv)"
            if "attention" in cfg.layer_types or cfg.parallel_attention
            else "-"
        )
        n = sum(p.numel() for p in hf.parameters())
        rows.append(
            f"| {arch} | {cfg.n_layers} ({kinds}) | {cfg.d_model} | {ssm} | {attn} | "
            f"{n / 1e6:.1f} M |"
        )
    return rows


def _progress(row: dict) -> None:
    """A measured row on stderr, as soon as it is measured (long runs)."""
    print(f"{row['arch']} {row['benchmark']}: {row['ratio']:.2f}x ({row['note']})", file=sys.stderr)
    sys.stderr.flush()


def _counts(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def bench_vs_hf(repeats: int, archs: list[str]) -> list[dict]:
    rows = []
    tokens = torch.randint(2, 320, (8, 256), generator=torch.Generator().manual_seed(0))
    for arch in archs:
        hf, model = _pair(arch)
        with torch.no_grad():
            t = _interleaved(
                {"hf": lambda hf=hf: hf(tokens).logits, "ours": lambda m=model: m(tokens)}, repeats
            )
            diff = (hf(tokens).logits - model(tokens)).abs().max().item()
        ratios = [o / h for o, h in zip(t["ours"], t["hf"], strict=True)]
        rows.append(
            dict(
                benchmark="fast path vs HF forward (8 x 256)",
                arch=arch,
                ours_s=statistics.median(t["ours"]),
                baseline_s=statistics.median(t["hf"]),
                ratio=statistics.median(ratios),
                goal="<= 1.0",
                note=f"max abs logit diff {diff:.1e}",
            )
        )
        _progress(rows[-1])
    return rows


def bench_materialized(repeats: int, archs: list[str]) -> list[dict]:
    """Whole forward with every SSM layer's pattern materialized vs the fast path.

    The Mamba-2 families materialize all heads. Mamba-1 has one matrix per channel (512 here,
    each a sum of ``d_state`` rank-1 terms), so it is also measured with 16 channels
    (``pattern_selection``).
    """
    rows = []
    cases: list[tuple[str, int, list[int] | None]] = [("mamba2", 256, None)]
    cases += [(arch, 1024, None) for arch in MAMBA2_FAMILIES]
    cases += [("mamba1", 256, None), ("mamba1", 1024, None), ("mamba1", 1024, list(range(16)))]
    cases = [c for c in cases if c[0] in archs]
    models = {arch: _pair(arch)[1] for arch in {c[0] for c in cases}}
    for arch, length, heads in cases:
        model = models[arch]
        tokens = torch.randint(2, 320, (1, length), generator=torch.Generator().manual_seed(1))

        def fast(tokens=tokens, model=model):
            return model(tokens)

        def materialized(tokens=tokens, model=model, heads=heads):
            hooks = [(lambda n: n.endswith("mixer.hook_pattern"), lambda x, hook: x)]
            with model.pattern_selection(heads=heads):
                return model.run_with_hooks(tokens, fwd_hooks=hooks)

        with torch.no_grad():
            t = _interleaved({"fast": fast, "mat": materialized}, repeats)
        ratios = [m / f for m, f in zip(t["mat"], t["fast"], strict=True)]
        which = "all heads" if heads is None else f"{len(heads)} of {model.cfg.n_heads} channels"
        rows.append(
            dict(
                benchmark=f"materialized vs fast path (1 x {length}, every SSM layer)",
                arch=arch,
                ours_s=statistics.median(t["mat"]),
                baseline_s=statistics.median(t["fast"]),
                ratio=statistics.median(ratios),
                goal="<= 3.0",
                note=which,
            )
        )
        _progress(rows[-1])
    return rows


def _status_kb(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in KiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _memory_child(arch: str, length: int, rows: str) -> None:
    """Print the peak RSS (MiB) added by materializing layer 0's pattern."""
    cfg = dict(CONFIGS[arch], num_hidden_layers=1)
    model = HookedSSM.from_hf_model(tiny_hf_model(arch, seed=0, **cfg), tiny_tokenizer())
    tokens = torch.randint(2, 320, (1, length))
    with torch.no_grad():
        model(tokens)  # warm-up on the fast path
        base = _status_kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
            f.write("5")
        name = "blocks.0.mixer.hook_pattern" if rows != "none" else "blocks.0.hook_resid_post"
        with model.pattern_selection(query_positions="last" if rows == "last" else None):
            _, cache = model.run_with_cache(tokens, names_filter=name)
        peak = _status_kb("VmHWM")
    shape = tuple(cache[name].shape)
    print(json.dumps({"delta_mib": (peak - base) / 1024, "shape": shape}))


def bench_memory(lengths: list[int]) -> list[dict]:
    rows = []
    for arch in ("mamba2", "mamba1"):
        for which in ("none", "last", "all"):
            for length in lengths:
                if which == "all" and arch == "mamba1" and length > 1024:
                    continue  # 512 channels x L^2 fp32 would need > 8 GB
                out = subprocess.run(
                    [sys.executable, __file__, "--memory-child", arch, str(length), which],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                res = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(
                    dict(
                        benchmark="peak memory of one layer's pattern",
                        arch=arch,
                        rows=which,
                        L=length,
                        delta_mib=round(res["delta_mib"], 1),
                        shape=res["shape"],
                    )
                )
    return rows


#: mamba2-130m's mixer (24 heads x 64, d_state 128, chunk 256) in 4 layers, for table 4.
MAMBA2_130M_LIKE = dict(
    hidden_size=768,
    num_hidden_layers=4,
    state_size=128,
    num_heads=24,
    head_dim=64,
    n_groups=1,
    chunk_size=256,
)

#: Table 4's runs: (label, hook on every layer's hook_pattern, budget).
PATTERN_RUNS = [
    ("fast path", None, None),
    ("materialized, budget 1 GiB", "identity", "1GiB"),
    ("materialized, budget 32 MiB", "identity", "32MiB"),
    ("materialized + edited (x * 1.0), budget 1 GiB", "edit", "1GiB"),
]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for the tables' captions."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _pattern_child(
    device: str, hook: str, budget: str, grad: bool, batch: int, length: int
) -> None:
    """Print the peak memory (MiB) and time of one forward (+ backward) above the state after a
    fast-path warm-up, and the layers' paths."""
    model = HookedSSM.from_hf_model(
        tiny_hf_model("mamba2", seed=0, **MAMBA2_130M_LIKE), tiny_tokenizer()
    ).to(device)
    tokens = torch.randint(2, 320, (batch, length), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    cuda = device.startswith("cuda")
    with torch.no_grad():
        model(tokens)  # warm-up on the fast path
    fns = {"identity": lambda x, hook: x, "edit": lambda x, hook: x * 1.0}
    is_pattern: Callable[[str], bool] = lambda n: n.endswith("mixer.hook_pattern")  # noqa: E731
    hooks: list[tuple[str | Callable[..., Any], Callable[..., Any]]] = []
    if hook != "none":
        hooks.append((is_pattern, fns[hook]))
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _status_kb("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    t0 = time.perf_counter()
    with torch.set_grad_enabled(grad), pattern_budget(budget):
        out = model.run_with_hooks(tokens, fwd_hooks=hooks, return_type="loss")
        if grad:
            out.backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _status_kb("VmHWM") * 1024
    seconds = time.perf_counter() - t0
    paths = sorted({p["scan"] for p in kernel_paths(model).values() if "scan" in p})
    print(json.dumps({"peak_mib": (peak - base) / 2**20, "s": seconds, "paths": paths}))


def bench_pattern_memory(device: str, batch: int, length: int) -> list[dict]:
    """Table 4: every SSM layer's pattern materialized, budget large vs small, vs the fast path;
    without and with gradients."""
    rows = []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    for grad in (False, True):
        fast_mib = None
        for label, hook, budget in PATTERN_RUNS:
            cmd = [sys.executable, __file__, "--pattern-child", device, hook or "none"]
            cmd += [budget or "512MiB", "grad" if grad else "nograd", str(batch), str(length)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            if fast_mib is None:
                fast_mib = res["peak_mib"]
            rows.append(
                dict(
                    benchmark="pattern budget",
                    grad=grad,
                    run=label,
                    peak_mib=round(res["peak_mib"]),
                    above_fast_mib=round(res["peak_mib"] - fast_mib),
                    s=round(res["s"], 2),
                    paths=res["paths"],
                )
            )
            print(f"{label} (grad={grad}): {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def print_pattern_memory(rows: list[dict], device: str, batch: int, length: int) -> None:
    where = device if not device.startswith("cuda") else torch.cuda.get_device_name(device)
    print(
        f"\nPattern budget: mamba2-130m-like mixers (4 layers), {batch} x {length}, every layer's "
        f"hook_pattern hooked, on {where} ({cpu_model()}); peak memory above the state after a "
        "fast-path warm-up.\n"
    )
    print("| gradients | run | peak (MiB) | above fast path (MiB) | time (s) | scan paths |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {'yes' if r['grad'] else 'no'} | {r['run']} | {r['peak_mib']} | "
            f"{r['above_fast_mib']} | {r['s']} | {', '.join(r['paths'])} |"
        )
    for grad in (False, True):
        by = {r["run"]: r for r in rows if r["grad"] == grad}
        large, small = by[PATTERN_RUNS[1][0]], by[PATTERN_RUNS[2][0]]
        print(
            f"\n{'With' if grad else 'Without'} gradients, budget 32 MiB vs 1 GiB: peak "
            f"{small['peak_mib'] / max(large['peak_mib'], 1):.2f}x, time "
            f"{small['s'] / max(large['s'], 1e-9):.2f}x."
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--memory-child", nargs=3, metavar=("ARCH", "L", "ROWS"))
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--archs", help="comma-separated families (default: all)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory tables")
    parser.add_argument("--pattern-memory", action="store_true", help="table 4 alone")
    parser.add_argument("--device", default="cpu", help="table 4's device (cpu, cuda)")
    parser.add_argument("--batch", type=int, default=1, help="table 4's batch")
    parser.add_argument("--length", type=int, default=1024, help="table 4's sequence length")
    parser.add_argument("--pattern-child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        arch, length, rows = args.memory_child
        _memory_child(arch, int(length), rows)
        return
    if args.pattern_child:
        device, hook, budget, grad, batch, length = args.pattern_child
        _pattern_child(device, hook, budget, grad == "grad", int(batch), int(length))
        return
    if args.pattern_memory:
        pattern = bench_pattern_memory(args.device, args.batch, args.length)
        print_pattern_memory(pattern, args.device, args.batch, args.length)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"pattern_memory": pattern}, f, indent=1)
        return
    torch.manual_seed(0)
    repeats = 3 if args.quick else 7
    print(
        f"# HookedSSM benchmarks\n\nMachine: {platform.machine()} ({cpu_model()}), "
        f"{torch.get_num_threads()} torch "
        f"threads, torch {torch.__version__}, Python {platform.python_version()}\n"
    )
    archs = args.archs.split(",") if args.archs else list(CONFIGS)
    unknown = sorted(set(archs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown --archs {unknown}; known: {list(CONFIGS)}")
    print("| family | layers | d_model | SSM | attention | parameters |")
    print("|---|---|---|---|---|---|")
    print("\n".join(describe(archs)) + "\n", flush=True)
    timing = bench_vs_hf(repeats, archs) + bench_materialized(repeats, archs)
    print("| benchmark | arch | ours (s) | baseline (s) | ratio (median) | goal | note |")
    print("|---|---|---|---|---|---|---|")
    for r in timing:
        print(
            f"| {r['benchmark']} | {r['arch']} | {r['ours_s']:.4f} | {r['baseline_s']:.4f} | "
            f"{r['ratio']:.2f}x | {r['goal']} | {r['note']} |"
        )
    memory = [] if args.no_memory else bench_memory([1024, 2048, 4096])
    if memory:
        print("\nQuery rows 'none': the fast path alone (no pattern), for reference.\n")
        print("| arch | query rows | L | pattern shape | peak RSS added (MiB) |")
        print("|---|---|---|---|---|")
    for r in memory:
        print(f"| {r['arch']} | {r['rows']} | {r['L']} | {tuple(r['shape'])} | {r['delta_mib']} |")
    pattern = [] if args.no_memory else bench_pattern_memory(args.device, args.batch, args.length)
    if pattern:
        print_pattern_memory(pattern, args.device, args.batch, args.length)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"timing": timing, "memory": memory, "pattern_memory": pattern}, f, indent=1)


if __name__ == "__main__":
    main()
