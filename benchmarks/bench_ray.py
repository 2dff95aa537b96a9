"""The scan's exact sweep of SmolLM2-135M's 270 heads: 2 Ray workers vs 1 process.

The setting of `gna-lens scan smollm2-135m --n-samples 16`'s selection sweep on the task: KV
retrieval (question template, 6 word pairs, 16 prompts, seed 0), every head ablated alone at
every position (zero ablation), metric: the answer's logit difference, float32. Measured side by
side in one run, interleaved when repeated:

- one process, 1 torch thread: ``ablation_sweep(model, task, "logit_diff")``;
- 2 Ray workers with 1 torch thread each (``RayExecutor(workers=2, threads_per_worker=1)`` on a
  local Ray instance of 2 CPUs), each loading the model by name in its own process: the wall
  time with the workers' start (actor start and model load) and without it (workers warm).

Also printed: ``ray.init`` time, whether the sharded values equal the single-process ones bit for
bit, the load average before and after, and the CPU time other processes took during each
measurement (cores' worth, from /proc/stat minus this process tree), so a run on a busy machine
says so. Prints markdown for benchmarks/RESULTS.md. About 8 minutes per repeat on 2 idle cores.

Also: two plain processes (no Ray), 1 thread each, sweeping the even and the odd layers at once:
what 2 workers get from this machine with no scheduling or transfer cost (memory bandwidth and
clocks shared), so the speedup can be read against it. It is not a strict ceiling: its split is
static (the even layers cost a few seconds more than the odd ones), where Ray's workers take
units as they finish; each half's time is printed (about 2 more minutes per repeat;
``--no-ceiling`` skips it).

Usage: python benchmarks/bench_ray.py [--repeats 1] [--n-samples 16] [--no-ceiling]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from gna_lens import ablation_sweep, load_model
from gna_lens.distributed import RayExecutor
from gna_lens.findings.experiments import smollm2_label
from gna_lens.tasks import kv_retrieval


class CpuMeter:
    """Cores' worth of CPU used by other processes (not this one or its descendants).

    Our processes' CPU time is sampled per process every ``interval`` seconds by a thread: a
    process that exits during the measurement (a Ray actor shut down by the step before) keeps
    the CPU it used within the measurement, and none from before it (summing the live
    descendants' totals at both ends would count a departed actor's whole life as other
    processes' use).
    """

    def __init__(self, interval: float = 0.25) -> None:
        self.me = psutil.Process()
        self.interval = interval
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.t0 = time.perf_counter()
        self.busy0 = self._busy()
        self.steal0 = self._steal()
        self._sample(initial=True)
        self.load0 = os.getloadavg()[0]
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0)

    @staticmethod
    def _steal() -> float:
        # Time the hypervisor ran something else while this VM's CPUs wanted to run: the host's
        # contention, invisible to the in-VM process accounting above.
        return getattr(psutil.cpu_times(), "steal", 0.0)

    def _sample(self, initial: bool = False) -> None:
        for p in [self.me, *self.me.children(recursive=True)]:
            try:
                c = p.cpu_times()
            except psutil.Error:
                continue
            with self.lock:
                # A process first seen later was born during the measurement: all its time counts.
                self.first.setdefault(p.pid, c.user + c.system if initial else 0.0)
                self.last[p.pid] = c.user + c.system

    def _poll(self) -> None:
        while not self.done.wait(self.interval):
            self._sample()

    def stop(self) -> dict[str, float]:
        self._sample()
        wall = time.perf_counter() - self.t0
        busy = self._busy() - self.busy0
        steal = self._steal() - self.steal0
        self.done.set()
        self.thread.join()
        with self.lock:
            ours = sum(self.last[pid] - self.first[pid] for pid in self.last)
        return {
            "wall": wall,
            "others": max(0.0, busy - ours) / wall,
            "steal": steal / wall,
            "load_before": self.load0,
            "load_after": os.getloadavg()[0],
        }


def _half(which: int, n_samples: int, out: str) -> None:
    """Child of the ceiling measurement: sweep the heads of every other layer, alone."""
    torch.set_num_threads(1)
    model = load_model("smollm2-135m")
    task = kv_retrieval(
        model.tokenizer, n_pairs=6, n_samples=n_samples, seed=0, template="question",
        values="words",
    )  # fmt: skip
    heads = [
        (layer, h)
        for layer in range(which, model.cfg.n_layers, 2)
        for h in range(model.cfg.n_heads)
    ]
    t0 = time.time()
    ablation_sweep(model, task, "logit_diff", heads, progress=False)
    with open(out, "w") as f:
        json.dump({"start": t0, "end": time.time(), "heads": len(heads)}, f)


def ceiling(n_samples: int) -> dict[str, float]:
    """Two plain processes (no Ray), 1 thread each, sweeping even / odd layers at once: what 2
    workers get on this machine without any scheduling or transfer cost (split statically)."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"{i}.json") for i in (0, 1)]
        cmd = [sys.executable, __file__, "--n-samples", str(n_samples)]
        procs = [subprocess.Popen([*cmd, "--half", str(i), "--half-out", outs[i]]) for i in (0, 1)]
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"ceiling child exited {p.returncode}")
        got = [json.loads(Path(o).read_text()) for o in outs]
    start = min(g["start"] for g in got)
    return {
        "wall": max(g["end"] for g in got) - start,
        "skew": max(g["start"] for g in got) - start,
        "each": [g["end"] - g["start"] for g in got],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--n-samples", type=int, default=16)
    parser.add_argument(
        "--no-ceiling", action="store_true", help="skip the two-process ceiling (no Ray)"
    )
    parser.add_argument("--half", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--half-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.half is not None:
        _half(args.half, args.n_samples, args.half_out)
        return
    torch.set_num_threads(1)
    print(f"load average at start: {os.getloadavg()}")
    import ray

    t0 = time.perf_counter()
    from gna_lens.distributed import ray_init_kwargs

    ray.init(**ray_init_kwargs(None, {"num_cpus": 2, "log_to_driver": False}))  # as RayExecutor
    t_init = time.perf_counter() - t0

    def fresh():
        # Each measurement starts from a freshly loaded model (not timed), as a user's first
        # sweep does: the per-model checks and timings cached on a model object by an earlier
        # measurement would otherwise favour whichever ran second.
        return load_model("smollm2-135m")

    model = fresh()
    tok = model.tokenizer
    task = kv_retrieval(
        tok, n_pairs=6, n_samples=args.n_samples, seed=0, template="question", values="words"
    )
    tokens = statistics.mean(len(s.input_ids) for s in task)
    local_runs, sharded_runs, start_runs, ceiling_runs = [], [], [], []
    local = sharded = None
    for rep in range(args.repeats):
        order = ["ray", "local"] if rep % 2 == 0 else ["local", "ray"]
        if not args.no_ceiling:
            order.insert(rep % 3, "ceiling")
        for which in order:
            if which == "ceiling":
                ceiling_runs.append(ceiling(args.n_samples))
                print(f"[{rep}] two plain processes: {ceiling_runs[-1]}", flush=True)
            elif which == "local":
                model = fresh()
                m = CpuMeter()
                local = ablation_sweep(model, task, "logit_diff", progress=False)
                local_runs.append(m.stop())
                print(f"[{rep}] one process: {local_runs[-1]}", flush=True)
            else:
                model = fresh()
                m = CpuMeter()
                ex = RayExecutor(workers=2, threads_per_worker=1)
                ex.start(model)
                start = m.stop()
                m2 = CpuMeter()
                sharded = ablation_sweep(model, task, "logit_diff", progress=False, executor=ex)
                sweep = m2.stop()
                sweep["executor"] = sharded.info["executor"]
                ex.close()
                start_runs.append(start)
                sharded_runs.append(sweep)
                print(f"[{rep}] 2 workers: start {start}, sweep {sweep}", flush=True)
                print(f"    executor: {sharded.info['executor']}", flush=True)
    assert local is not None and sharded is not None
    same = torch.equal(local.values, sharded.values) and torch.equal(
        local.baseline, sharded.baseline
    )
    diff = float((local.values - sharded.values).abs().max())
    t_local = statistics.median(r["wall"] for r in local_runs)
    t_sweep = statistics.median(r["wall"] for r in sharded_runs)
    t_start = statistics.median(r["wall"] for r in start_runs)
    ratios_warm = [a["wall"] / b["wall"] for a, b in zip(local_runs, sharded_runs, strict=True)]
    ratios_cold = [
        a["wall"] / (b["wall"] + c["wall"])
        for a, b, c in zip(local_runs, sharded_runs, start_runs, strict=True)
    ]
    n = len(local.cells)
    info = sharded.info["executor"]
    print(f"\n{smollm2_label(model)}; {len(task)} prompts of {tokens:.1f} tokens on average")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"ray {ray.__version__}; sweep path: {local.method}, {local.info['paths']}\n"
    )
    print("| measurement | value |")
    print("|---|---|")
    print(f"| `ray.init(num_cpus=2)` | {t_init:.1f} s |")
    print(f"| one process, 1 thread: all {n} heads | {t_local:.1f} s ({t_local / n:.3f} s/head) |")
    print(
        f"| 2 Ray workers x 1 thread: start (2 actors, model loaded in each) | {t_start:.1f} s "
        f"(load {', '.join(f'{s:.1f}' for s in info['load_seconds'])} s) |"
    )
    print(
        f"| 2 Ray workers x 1 thread: the sweep, workers warm | {t_sweep:.1f} s "
        f"({t_sweep / n:.3f} s/head; {info['units']} units, {info['units_by_worker']} per worker) |"
    )
    print(
        f"| speedup, workers warm / with their start | {statistics.median(ratios_warm):.2f}x / "
        f"{statistics.median(ratios_cold):.2f}x (goal >= 1.6x) |"
    )
    if ceiling_runs:
        t_ceil = statistics.median(r["wall"] for r in ceiling_runs)
        ratios_ceil = [a["wall"] / c["wall"] for a, c in zip(local_runs, ceiling_runs, strict=True)]
        print(
            f"| reference: 2 plain processes x 1 thread (no Ray), even / odd layers, at once | "
            f"{t_ceil:.1f} s; speedup {statistics.median(ratios_ceil):.2f}x over one process "
            f"(each half: "
            + "; ".join(" / ".join(f"{e:.1f}" for e in r["each"]) for r in ceiling_runs)
            + f" s; start skew {statistics.median(r['skew'] for r in ceiling_runs):.1f} s) |"
        )
    busy = [r["executor"]["busy_seconds"] for r in sharded_runs]
    cpu = [r["executor"]["cpu_seconds"] for r in sharded_runs]
    serial = [r["wall"] - r["executor"]["wall_seconds"] for r in sharded_runs]
    print(
        "| 2 Ray workers: each worker's seconds inside its units (CPU seconds) | "
        + "; ".join(
            ", ".join(f"{b:.1f} ({c:.1f})" for b, c in zip(bs, cs, strict=True))
            for bs, cs in zip(busy, cpu, strict=True)
        )
        + " |"
    )
    print(
        "| 2 Ray workers: the caller's own time before the workers start (planning) | "
        + "; ".join(f"{x:.1f} s" for x in serial)
        + " |"
    )
    print(f"| sharded values == one process | {same} (max abs diff {diff:.1e}) |")
    for name, runs in (("one process", local_runs), ("2 workers (sweep)", sharded_runs)):
        print(
            f"| load average before / after, {name} | "
            + "; ".join(f"{r['load_before']:.2f} / {r['load_after']:.2f}" for r in runs)
            + " |"
        )
        print(
            f"| other processes' CPU during {name} (cores) | "
            + "; ".join(f"{r['others']:.2f}" for r in runs)
            + " |"
        )
        print(
            f"| CPU taken by the host (steal) during {name} (cores) | "
            + "; ".join(f"{r['steal']:.3f}" for r in runs)
            + " |"
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
