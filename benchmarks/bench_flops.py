"""The demo scan's floating-point work against what the CPU can do (gna_lens issue 42).

Reads the ``report.json`` of a ``make demo`` run (``gna-lens scan smollm2-135m --task kv
--n-samples 16 --n-eval 48 --top 4 --sweep-dtype auto``) and prints, per stage of the scan:
the forward FLOPs it needed, its seconds (the report's ``timings`` / ``timings_heads``), the rate
it achieved, and the machine's measured float32 matmul rate at the model's shapes.

How the FLOPs are counted: measured, then multiplied out.

- **Measured**: ``torch.utils.flop_counter.FlopCounterMode`` on a real forward of one row of
  every prompt length the scan runs (the model as loaded, e.g. SmolLM2-135M): the FLOPs of each
  block (``blocks.{i}``), of the last block's MLP, and of the unembedding per position (all that
  is outside the blocks). FlopCounterMode counts matrix products (``mm``, ``bmm``, ``addmm``,
  attention kernels), not elementwise work (norms, softmax, rotary, residual adds).
- **Multiplied out**: a cell whose heads' lowest layer is ``l`` runs blocks ``l..L-1`` on each
  of its prompts at every position, and the unembedding on the positions its metric reads (a task
  sweep: the last; a control sweep: the window's scored tokens, ``n_scored``, half the window);
  every sweep adds its clean run (every block) per prompt. Where the report's paths say the run
  was truncated after the last block's mixer (``tail: last k position(s)``), the last block's MLP
  is counted at those ``k`` positions only. Where they say a group's shared prefix ran once
  per cell (``prefix: once per cell``), its positions count once per cell, not once per
  prompt (a block's FLOPs taken as proportional to the positions it runs). Full forwards (baseline check, pattern scores,
  examples) run every block and the unembedding at every position of their padded batches (8
  prompts). The cells come from the scan itself: every measured head alone (task and control
  sweeps), the joint walk's head sets (replayed from the report's joint set, checked against its
  method line), and the held-out stage's sets (the top heads and the random sets in the report)
  on each held-out task and the held-out control.

Not counted (listed in the table's notes): the engine's one-time checks (its shortcut verdicts
run a few forwards twice), the bridge's one-row run of the blocks below the start layer per
forward pass (its residual swap), the sweep-dtype probe and check, and elementwise work.

The machine's rate: ``torch.mm`` at the model's matrix shapes (rows x d_model by d_model x
d_mlp, d_mlp x d_model, d_model x q/kv widths, d_model x vocab), ``--threads`` threads, best of
``--repeats``; a stage's share is its achieved rate over the best of those (bfloat16 matmuls
too, when the report's selection sweeps ran under bfloat16 autocast).

Usage: python benchmarks/bench_flops.py [--report reports/demo/report.json] [--json OUT]
[--markdown] [--threads 2]
"""

import argparse
import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

Head = tuple[int, int]

#: Rows of the padded batches the full forwards run (evaluate, pattern_scores: batch_size=8).
FULL_BATCH = 8


# ----------------------------------------------------------------------------- measured costs
@dataclass(frozen=True)
class RowCost:
    """Measured forward FLOPs of one row of ``length`` tokens.

    Attributes:
        length: Tokens in the row.
        blocks: FLOPs of each block, all positions.
        last_mlp: FLOPs of the last block's MLP, all positions (the engine's tail truncation
            runs it at the read positions only).
        unembed: FLOPs of the unembedding (with the final norm: all that is outside the blocks)
            per position.
    """

    length: int
    blocks: tuple[float, ...]
    last_mlp: float
    unembed: float

    def cell(self, start: int, keep: int, tail: bool = False) -> float:
        """FLOPs of one row run from block ``start`` with the logits of ``keep`` positions;
        ``tail``: the last block's MLP at those ``keep`` positions only."""
        flops = sum(self.blocks[start:]) + keep * self.unembed
        if tail:
            flops -= self.last_mlp * (self.length - keep) / self.length
        return flops


_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)$")
_MLP = re.compile(r"(?:^|\.)blocks\.(\d+)\.mlp$")


def _module_flops(counter: Any, pattern: re.Pattern[str], n: int) -> list[float]:
    """Per index ``0..n-1``: the FLOPs of the module named ``...<pattern>`` (each must appear)."""
    out: dict[int, float] = {}
    for name, ops in counter.get_flop_counts().items():
        m = pattern.search(name)
        if m is not None:
            out.setdefault(int(m.group(1)), float(sum(ops.values())))
    missing = [i for i in range(n) if i not in out]
    if missing:
        raise ValueError(
            f"FlopCounterMode found no module matching {pattern.pattern!r} for indices "
            f"{missing[:5]}; expected a model whose blocks are named blocks.<i> (a "
            "TransformerBridge or a HookedSSM). Fix: pass such a model."
        )
    return [out[i] for i in range(n)]


def measure_row_costs(model: Any, lengths: Sequence[int], token: int = 1) -> dict[int, RowCost]:
    """:class:`RowCost` of every length in ``lengths``: one full forward of one row each, under
    ``FlopCounterMode`` (logits at every position)."""
    from torch.utils.flop_counter import FlopCounterMode

    from gna_lens.heads import Subject

    subject = Subject.of(model)
    n_layers = subject.view.n_layers
    out = {}
    for length in sorted(set(lengths)):
        tokens = torch.full((1, length), token, dtype=torch.long, device=subject.device)
        with torch.no_grad(), FlopCounterMode(display=False, depth=None) as counter:
            subject.model(tokens)
        blocks = _module_flops(counter, _BLOCK, n_layers)
        mlp = _module_flops(counter, _MLP, n_layers)[-1]
        outside = float(counter.get_total_flops()) - sum(blocks)
        out[length] = RowCost(length, tuple(blocks), mlp, outside / length)
    return out


# ----------------------------------------------------------------------------- what the scan ran
@dataclass(frozen=True)
class Sweep:
    """One head sweep as the engine runs it: every cell on every prompt, plus the clean run.

    Attributes:
        lengths: Each prompt's (window's input) length.
        starts: Each cell's start layer (its heads' lowest layer).
        keep: Positions whose logits the metric reads.
        tail: Whether the last block's MLP ran at those positions only.
    """

    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    keep: int
    tail: bool
    clean: bool = True  # False: it reused an earlier sweep's clean run (shared_clean_runs)
    prefix: tuple[tuple[int, int], ...] = ()  # (length, positions run once per cell)

    def flops(self, costs: dict[int, RowCost]) -> float:
        total, prefix = 0.0, dict(self.prefix)
        for length, n in Counter(self.lengths).items():
            c = costs[length]
            total += n * c.cell(0, self.keep, self.tail) * self.clean  # the clean run
            once = (n - 1) * prefix.get(length, 0) / length  # rows' worth not run per prompt
            total += sum(n * c.cell(s, self.keep, self.tail) - once * sum(c.blocks[s:])
                         for s in self.starts)  # fmt: skip
        return total

    @property
    def cells(self) -> int:
        return len(self.starts)


@dataclass(frozen=True)
class Forward:
    """Full forwards of padded batches (every block, the logits of every position)."""

    batch_lengths: tuple[tuple[int, int], ...]  # (rows, padded length) per batch

    def flops(self, costs: dict[int, RowCost]) -> float:
        return sum(rows * costs[n].cell(0, n) for rows, n in self.batch_lengths)


@dataclass
class Stage:
    """One stage of the scan: what it ran (``work``), its seconds, and how it was counted
    (``counted``; ``uncounted``: a stage whose forwards this benchmark does not count)."""

    name: str
    seconds: float
    work: list[Sweep | Forward] = field(default_factory=list)
    precision: str = "float32"
    counted: str = ""
    uncounted: bool = False
    flops: float = math.nan

    def count(self, costs: dict[int, RowCost]) -> None:
        if not self.uncounted:
            self.flops = float(sum(w.flops(costs) for w in self.work))


def start_layer(cell: Sequence[Head]) -> int:
    return min(layer for layer, _ in cell)


def padded_batches(lengths: Sequence[int], batch: int = FULL_BATCH) -> tuple[tuple[int, int], ...]:
    """``(rows, padded length)`` of the batches of ``batch`` prompts in order."""
    return tuple(
        (len(lengths[i : i + batch]), max(lengths[i : i + batch]))
        for i in range(0, len(lengths), batch)
    )


def _tail(paths: dict[str, Any], keep: int) -> bool:
    """Whether a sweep's paths say the last block's MLP ran at ``keep`` positions only."""
    return f"last {keep} position(s)" in paths.get("tail", [])


def shared_prefixes(task: Any, paths: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    """``(length, shared positions)`` of each prompt length of ``task`` whose shared prefix a
    sweep with ``paths`` ran once per cell (none unless its paths say so)."""
    from gna_lens.interventions.engine import shared_prefixes as of

    if not any(p.startswith("once per cell") for p in paths.get("prefix", [])):
        return ()
    return tuple((n, P) for n, (_, P) in of([s.input_ids for s in task]).items())


def replay_joint_walk(report: Any) -> list[list[list[Head]]]:
    """The head sets of every control sweep the greedy joint walk ran, replayed from a
    :class:`~gna_lens.scoring.GnaReport`'s joint set; checked against its
    ``method["joint_control"]`` line.

    Raises:
        ValueError: When the replay does not give the report's joint set or its counts.
    """
    from gna_lens.scoring.pipeline import _joint_walk

    js = report.joint_set
    if js is None:
        return []
    accepted, turned_down = set(js.heads), {r.head for r in js.rejected}
    sweeps: list[list[list[Head]]] = []

    def measure(sets: list[list[Head]]) -> torch.Tensor:
        sweeps.append(sets)
        rows = [0.0 if s[-1] in accepted else math.inf if s[-1] in turned_down else math.nan
                for s in sets]  # fmt: skip
        return torch.tensor(rows, dtype=torch.float64, device="cpu")[:, None]

    zeros = torch.zeros((len(report.heads), 1), dtype=torch.float64, device="cpu")
    joint, line = _joint_walk(
        None, None, report, zeros, js.joint_k, mode=report.method.get("mode", "zero"),  # type: ignore[arg-type]
        positions=None, progress=False, measure=measure,
    )  # fmt: skip
    said = re.search(r"\((\d+) sweeps of (\d+) head sets\)", report.method.get("joint_control", ""))
    got = re.search(r"\((\d+) sweeps of (\d+) head sets\)", line)
    assert got is not None
    if joint.heads != js.heads or [r.head for r in joint.rejected] != [r.head for r in js.rejected]:
        raise ValueError(
            f"replaying the joint walk gave heads {joint.heads} (turned down "
            f"{[r.head for r in joint.rejected]}), the report {js.heads} (turned down "
            f"{[r.head for r in js.rejected]}); expected the same walk. Fix: a report written by "
            "this version of gna_lens."
        )
    if said is None or said.groups() != got.groups():
        raise ValueError(
            f"replaying the joint walk gave {got.group(0)}, the report's method line says "
            f"{said.group(0) if said else 'nothing'}; expected the same sweeps."
        )
    return sweeps


@dataclass(frozen=True)
class ScanInputs:
    """The prompts a scan ran: the selection task, the held-out tasks, the two controls."""

    selection: Any
    held_out: dict[str, Any]
    control_select: Any
    control_eval: Any


def rebuild_inputs(report: dict[str, Any], tokenizer: Any) -> ScanInputs:
    """The prompts of a ``gna-lens scan --task kv`` run with the prose control, built again from
    the report's settings and checked against its counts and descriptions.

    Raises:
        ValueError: For a scan this benchmark cannot rebuild (another task or control), or
            prompts that do not match the report's.
    """
    from gna_lens.scan import build_tasks
    from gna_lens.tasks.control import resolve_control

    method = report["method"]
    held = method.get("held_out_prompts", {})
    if not any(name.startswith("kv-") for name in held):
        raise ValueError(
            f"report's held-out tasks {sorted(held)}; expected a `--task kv` scan (the demo's). "
            "Fix: --report of a `gna-lens scan ... --task kv` run."
        )
    n_pairs = int(next(iter(held)).split("-")[1])
    template, values = method.get("tasks_template", "question, words values").split(", ")
    sets = build_tasks(
        tokenizer, "kv", n_samples=int(method["selection_prompts"]),
        seed=int(method.get("tasks_selection_seed", 0)), n_pairs=n_pairs,
        n_eval=max(held.values()), template=template, values=values.removesuffix(" values"),
    )  # fmt: skip
    if {k: len(v) for k, v in sets.held_out.items()} != held:
        raise ValueError(
            f"rebuilt held-out tasks { ({k: len(v) for k, v in sets.held_out.items()}) }, the "
            f"report's {held}; expected the same."
        )
    positions = None if method.get("positions") in (None, "all") else method["positions"]
    c_sel = resolve_control("prose", tokenizer, positions=positions, split="select")
    c_eval = resolve_control("prose", tokenizer, positions=positions, split="eval")
    for what, control, said in (
        ("control", c_sel, method.get("control")),
        ("control_eval", c_eval, method.get("control_eval")),
    ):
        if control.describe() != said:
            raise ValueError(
                f"the rebuilt {what} is {control.describe()!r}, the report's {said!r}; expected "
                "the shipped prose (the scan's default control)."
            )
    return ScanInputs(sets.selection, dict(sets.held_out), c_sel, c_eval)


def scan_stages(data: dict[str, Any], inputs: ScanInputs) -> list[Stage]:
    """The stages of the scan in ``data`` (a ``report.json``) and the work each ran.

    Raises:
        ValueError: For a scan other than the exact strategy at every position (the demo's).
    """
    from gna_lens.scoring import GnaReport

    method = data["method"]
    if method.get("strategy") != "exact" or method.get("positions") != "all":
        raise ValueError(
            f"report of strategy {method.get('strategy')!r}, positions "
            f"{method.get('positions')!r}; this benchmark counts the demo's scan (strategy "
            "'exact', every position). Fix: --report of a `make demo` run."
        )
    report = GnaReport.from_dict(data)
    timings, heads_t = data["timings"], data["timings_heads"]
    sel = [s.n_tokens for s in inputs.selection]
    effects = report.scores["ablation_effect"].tolist()
    measured = [h for h, e in zip(report.heads, effects, strict=True) if not math.isnan(e)]
    paths = method.get("paths", {})
    precision = str(method.get("sweep_dtype", "float32"))
    c_len = int(inputs.control_select.tokens.shape[1]) - 1  # a window minus its last token
    keep = int(inputs.control_select.seq_len) // 2  # control_sweep's n_scored default
    c_tail = _tail(paths.get("control", {}), keep)

    def control_sweep(
        control: Any, cells: Sequence[Sequence[Head]], tail: bool, clean: bool = True
    ) -> Sweep:
        n, length = control.tokens.shape
        return Sweep((length - 1,) * n, tuple(start_layer(c) for c in cells), keep, tail, clean)

    # control effects alone: every head, or (control_scope "needed") the first ones in
    # ablation-effect order, 2 * joint_k and then joint_k per sweep
    ctrl = report.scores["control_effect"].tolist()
    alone = [h for h, c in sorted(zip(report.heads, ctrl, strict=True),
             key=lambda hc: effects[report.heads.index(hc[0])]) if not math.isnan(c)]  # fmt: skip
    chunks = [alone]
    if "control_scope" in method and report.joint_set is not None:
        k = report.joint_set.joint_k
        chunks = [alone[: 2 * k]] + [alone[i : i + k] for i in range(2 * k, len(alone), k)]

    stages = [Stage("tasks", timings.get("tasks", 0.0), counted="building prompts: no forward")]
    stages.append(Stage(
        "baseline_check", timings.get("baseline_check", math.nan),
        [Forward(padded_batches(sel))],
        counted=f"{len(sel)} selection prompts, full forwards, batches of {FULL_BATCH} padded",
    ))  # fmt: skip
    stages.append(Stage(
        "heads: pattern_scores", heads_t.get("pattern_scores", math.nan),
        [Forward(padded_batches(sel))],
        counted=f"{len(sel)} selection prompts, full forwards, batches of {FULL_BATCH} padded",
    ))  # fmt: skip
    single = tuple(start_layer([h]) for h in measured)
    stages.append(Stage(
        "heads: ablation_sweep", heads_t.get("ablation_sweep", math.nan),
        [Sweep(tuple(sel), single, 1, _tail(paths.get("ablation", {}), 1),
               prefix=shared_prefixes(inputs.selection, paths.get("ablation", {})))], precision,
        counted=f"{len(single)} heads x {len(sel)} prompts + clean runs; last-position logits",
    ))  # fmt: skip
    n_win = int(inputs.control_select.tokens.shape[0])
    stages.append(Stage(
        "heads: control_sweep", heads_t.get("control_sweep", math.nan),
        [control_sweep(inputs.control_select, [[h] for h in c], c_tail) for c in chunks],
        precision,
        counted=f"{len(alone)} heads x {n_win} windows of {c_len} tokens in {len(chunks)} "
        f"sweep(s), each + its clean run; logits of the last {keep} positions",
    ))  # fmt: skip
    walk = replay_joint_walk(report)
    shared = "share one clean run" in method.get("joint_control", "")
    walk_sweeps = [
        control_sweep(inputs.control_select, sets, c_tail, clean=not shared or i == 0)
        for i, sets in enumerate(walk)
    ]
    joint_cells = sum(len(s) for s in walk)
    stages.append(Stage(
        "heads: joint_control", heads_t.get("joint_control", math.nan),
        walk_sweeps, precision,
        counted=f"{len(walk)} control sweeps of {joint_cells} head sets (replayed), "
        + ("one clean run shared by all" if shared else "each + its clean run"),
    ))  # fmt: skip
    stages.append(Stage(
        "heads: examples", heads_t.get("examples", math.nan),
        [Forward(((1, sel[0]),))] if "examples" in heads_t else [],
        counted="one full forward of the first selection prompt",
    ))  # fmt: skip
    rest = timings.get("heads", math.nan) - sum(heads_t.values())
    stages.append(Stage(
        "heads: rest", rest, uncounted=True, counted="not counted: the sweep-dtype choice "
        "(probe and check) and the report's assembly",
    ))  # fmt: skip
    held = data["held_out"]
    cells = [held["heads"], *held["random_sets"]]
    cells = [[tuple(h) for h in c] for c in cells]
    held_paths = held.get("method", {}).get("paths", {})
    if "ablation_sweep" not in held.get("method", {}).get("accuracy_path", "ablation_sweep"):
        raise ValueError(
            f"held-out accuracies computed by {held['method']['accuracy_path']!r}; this "
            "benchmark counts the ablation-sweep path (single-token choices)."
        )
    # A task whose random sets were not run (the model is not above chance on it): its set only.
    skipped = {r["task"] for r in held.get("rows", []) if r.get("random_note")}
    work: list[Sweep | Forward] = [
        Sweep(tuple(s.n_tokens for s in task),
              tuple(start_layer(c) for c in (cells[:1] if name in skipped else cells)), 1,
              _tail(held_paths.get(name, {}), 1),
              prefix=shared_prefixes(task, held_paths.get(name, {})))
        for name, task in inputs.held_out.items()
    ]  # fmt: skip
    n_eval = int(inputs.control_eval.tokens.shape[0])
    work.append(
        control_sweep(inputs.control_eval, cells, _tail(held_paths.get("control", {}), keep))
    )
    stages.append(Stage(
        "held_out", timings.get("held_out", math.nan), work,
        counted=f"{len(cells)} head sets ({len(cells[0])} top + {len(cells) - 1} random) x "
        f"({' + '.join(str(len(t)) for t in inputs.held_out.values())}) prompts and "
        f"{n_eval} control windows, + clean runs"
        + (f"; {', '.join(sorted(skipped))}: the top set only" if skipped else ""),
    ))  # fmt: skip
    if "report" in timings:
        stages.append(Stage("report", timings["report"], counted="writing HTML / JSON: no forward"))
    return stages


def all_lengths(stages: Sequence[Stage]) -> set[int]:
    out: set[int] = set()
    for stage in stages:
        for w in stage.work:
            out |= set(w.lengths) if isinstance(w, Sweep) else {n for _, n in w.batch_lengths}
    return out


# ----------------------------------------------------------------------------- machine rate
def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """GFLOP/s of ``torch.mm`` of ``[m, k] x [k, n]`` in ``dtype``: the best of ``repeats``
    timings (each of enough products for ~0.1 s)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn((m, k), generator=gen, device="cpu").to(dtype)
    b = torch.randn((k, n), generator=gen, device="cpu").to(dtype)
    out = torch.empty((m, n), dtype=dtype, device="cpu")
    torch.mm(a, b, out=out)
    t0 = time.perf_counter()
    torch.mm(a, b, out=out)
    reps = max(1, int(0.1 / max(time.perf_counter() - t0, 1e-6)))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2.0 * m * k * n / best / 1e9


def model_shapes(cfg: Any, rows: int) -> list[tuple[str, int, int, int]]:
    """``(what, m, k, n)`` of the model's weight products for ``rows`` token positions."""
    d, mlp, vocab = int(cfg.d_model), int(cfg.d_mlp), int(cfg.d_vocab)
    heads, d_head = int(cfg.n_heads), int(cfg.d_head)
    kv = int(getattr(cfg, "n_key_value_heads", None) or heads) * d_head
    return [
        ("MLP in (gate, up)", rows, d, mlp),
        ("MLP out", rows, mlp, d),
        ("attention q / o", rows, d, heads * d_head),
        ("attention k / v", rows, d, kv),
        ("unembedding", rows, d, vocab),
    ]


# ----------------------------------------------------------------------------- output
def table_rows(stages: Sequence[Stage], rates: dict[str, float]) -> list[dict[str, Any]]:
    """The table: per stage, then the total (the machine rate: float32, or bfloat16 for a
    stage under bfloat16 autocast)."""
    rows = []
    for s in stages:
        peak = rates.get("bfloat16" if "bfloat16" in s.precision else "float32", math.nan)
        achieved = s.flops / s.seconds / 1e9 if s.seconds > 0 and s.flops > 0 else math.nan
        rows.append({
            "stage": s.name, "tflop": s.flops / 1e12, "seconds": s.seconds,
            "achieved_gflops": achieved, "precision": s.precision, "machine_gflops": peak,
            "share": achieved / peak, "counted": s.counted,
        })  # fmt: skip
    flops = sum(s.flops for s in stages if not s.uncounted)
    seconds = sum(s.seconds for s in stages)
    peak = rates.get("float32", math.nan)
    rows.append({
        "stage": "total", "tflop": flops / 1e12, "seconds": seconds,
        "achieved_gflops": flops / seconds / 1e9, "precision": "float32",
        "machine_gflops": peak, "share": flops / seconds / 1e9 / peak,
        "counted": "every stage above (an uncounted one adds seconds, no FLOPs)",
    })  # fmt: skip
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or math.isnan(x) else format(x, spec)


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def markdown(result: dict[str, Any]) -> str:
    """The result as markdown: the stage table, the matmul rates, the notes."""
    lines = [
        f"{result['model']}, {result['report']}; {result['machine']}, {result['threads']} "
        f"torch thread(s), torch {result['torch']}; load average {result['load_average']:.1f} "
        "before the matmul timings",
        "",
        "| stage | TFLOP | s | achieved GFLOP/s | machine matmul GFLOP/s | share | work counted |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["stages"]:
        bf16 = " (bfloat16)" if "bfloat16" in r["precision"] else ""
        lines.append(
            f"| {r['stage']} | {_fmt(r['tflop'], '.3f')} | {_fmt(r['seconds'], '.1f')} | "
            f"{_fmt(r['achieved_gflops'], '.1f')} | {_fmt(r['machine_gflops'], '.0f')}{bf16} | "
            f"{_pct(r['share'])} | {r['counted']} |"
        )
    lines += ["", "| matmul | shape | dtype | GFLOP/s |", "|---|---|---|---:|"]
    for m in result["matmul"]:
        lines.append(
            f"| {m['what']} | [{m['m']}, {m['k']}] x [{m['k']}, {m['n']}] | {m['dtype']} | "
            f"{m['gflops']:.1f} |"
        )
    lines += ["", "Notes:", *(f"- {n}" for n in result["notes"])]
    return "\n".join(lines)


def plain(result: dict[str, Any]) -> str:
    """The result as plain text."""
    out = [
        markdown(result).splitlines()[0],
        "",
        f"{'stage':<24} {'TFLOP':>8} {'s':>7} {'GFLOP/s':>8} {'machine':>8} {'share':>6}",
    ]
    for r in result["stages"]:
        out.append(
            f"{r['stage']:<24} {_fmt(r['tflop'], '.3f'):>8} {_fmt(r['seconds'], '.1f'):>7} "
            f"{_fmt(r['achieved_gflops'], '.1f'):>8} {_fmt(r['machine_gflops'], '.0f'):>8} "
            f"{_pct(r['share']):>6}"
        )
    out.append("")
    for m in result["matmul"]:
        shape = f"[{m['m']}x{m['k']}]x[{m['k']}x{m['n']}]"
        out.append(f"matmul {m['what']} {shape} {m['dtype']}: {m['gflops']:.1f} GFLOP/s")
    out += ["", *(f"note: {n}" for n in result["notes"])]
    return "\n".join(out)


def _json_ready(x: Any) -> Any:
    """NaN as ``None`` (JSON has no NaN)."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _json_ready(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_ready(v) for v in x]
    return x


NOTES = [
    "FLOPs: FlopCounterMode (matrix products: mm, bmm, addmm, attention) on one-row forwards "
    "at every prompt length the scan ran, multiplied by each stage's cells and prompts; "
    "elementwise work (norms, softmax, rotary, residual adds) is not counted",
    "a cell runs the blocks from its heads' lowest layer on every position of its prompts "
    "(a shared prefix the paths say ran once per cell: once per cell) and "
    "the unembedding at the positions its metric reads; each sweep adds one clean run per "
    "prompt; full forwards (baseline check, pattern scores, examples) run padded batches of 8 "
    "with logits at every position",
    "not counted: the engine's one-time shortcut checks (a few forwards run twice), the "
    "bridge's one-row run of the blocks below a cell's start layer per forward pass (twice "
    "where the shared prefix runs first), the "
    "sweep-dtype probe and check ('heads: rest'), and the first clean run's untruncated tail",
    "machine rate: torch.mm at the model's shapes, best of the repeats; the share compares a "
    "stage with the best of those shapes (its own matmul mix may run slower); both the rate and "
    "the report's seconds are the machine's only if its cores were idle (load average above)",
]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Count the report's scan, measure the machine, return the result (JSON-ready)."""
    from gna_lens.runtime import cpu_description
    from gna_lens.scan import load_scan_model

    data = json.loads(Path(args.report).read_text(encoding="utf-8"))
    name = args.model or data["provenance"].get("name") or data["model_name"]
    torch.set_num_threads(args.threads)
    model = load_scan_model(name, device="cpu")
    inputs = rebuild_inputs(data, model.tokenizer)
    stages = scan_stages(data, inputs)
    costs = measure_row_costs(model, sorted(all_lengths(stages)))
    for s in stages:
        s.count(costs)
    cfg = model.cfg
    dtypes = [torch.float32]
    if any("bfloat16" in s.precision for s in stages):
        dtypes.append(torch.bfloat16)
    load = os.getloadavg()[0]  # the rates below are the machine's only on idle cores
    matmul = []
    for dtype in dtypes:
        for what, m, k, n in model_shapes(cfg, args.rows):
            gflops = matmul_rate(m, k, n, dtype, args.repeats)
            matmul.append(dict(what=what, m=m, k=k, n=n, dtype=str(dtype).split(".")[-1],
                               gflops=gflops))  # fmt: skip
    rates = {
        d: max(x["gflops"] for x in matmul if x["dtype"] == d) for d in {x["dtype"] for x in matmul}
    }
    return {
        "report": str(args.report),
        "model": name,
        "command": data.get("command"),
        "machine": cpu_description(),
        "threads": torch.get_num_threads(),
        "load_average": load,
        "torch": torch.__version__,
        "stages": table_rows(stages, rates),
        "matmul": matmul,
        "rates": rates,
        "row_costs": {str(k): asdict(v) for k, v in costs.items()},
        "notes": NOTES,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", default="reports/demo/report.json",
                        help="report.json of a `make demo` run")  # fmt: skip
    parser.add_argument("--model", default=None, help="the model (default: the report's)")
    parser.add_argument("--json", default=None, help="write the result as JSON here")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=64 * 47,
                        help="rows of the timed matmuls (token positions per forward)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    result = run(args)
    print(markdown(result) if args.markdown else plain(result))
    if args.json:
        Path(args.json).write_text(json.dumps(_json_ready(result), indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
