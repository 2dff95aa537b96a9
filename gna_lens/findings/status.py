"""The status of each claim on the findings page, from the experiments' results: the rules of
:mod:`gna_lens.findings.rules` applied to each experiment's numbers (no markdown here; the page
is written by :mod:`gna_lens.findings.render`).

The statuses (reproduced, partly, inconclusive, not reproduced, not testable offline, no result;
not attempted: a claim of the paper that no experiment here addresses, with the reason) are
defined on the page, next to the status table.

A status never credits a role the measurement does not show: the hybrid row is *partly* only when
denying the *attention* candidates' aggregate patterns lowers retrieval.
"""

from collections.abc import Mapping, Sequence
from typing import Any

from gna_lens.findings.rules import (
    FLAT_NATS,
    FLAT_POINTS,
    INCONCLUSIVE,
    effect,
    holm,
    interval_p_value,
    p_text,
    within_margin,
)
from gna_lens.render.markdown import format_nats as _nats
from gna_lens.render.markdown import format_number as _num
from gna_lens.render.markdown import format_percent as _pct
from gna_lens.render.markdown import format_points as _pts
from gna_lens.render.markdown import format_share as _share

__all__ = ["seed_claims", "set_level_comparisons", "status_rows"]

REPRODUCED, PARTLY, NOT, UNTESTABLE, NO_RESULT, NOT_ATTEMPTED = (
    "reproduced",
    "partly",
    "not reproduced",
    "not testable offline",
    "no result",
    "not attempted",
)


#: The claim of the retrieval rows (SmolLM2's top k, each template's top k).
FEW_HEADS = "Removing a few heads drops in-context retrieval to chance; as many random heads do not"


def _status(
    claim: str, model: str, numbers: str, verdict: tuple[str, str], **extra: str
) -> dict[str, str]:
    """A status row: ``claim, model, numbers, status, why`` (and ``extra``, e.g. ``label``)."""
    return {"claim": claim, "model": model, "numbers": numbers, "status": verdict[0],
            "why": verdict[1], **extra}  # fmt: skip


def _row(table: Mapping[str, Any], task: str) -> Mapping[str, Any]:
    return next(r for r in table["rows"] if r["task"] == task)


def _does(row: Mapping[str, Any]) -> bool:
    """The model does the task: its accuracy interval lies above chance."""
    return row["before"]["low"] is not None and row["before"]["low"] > row["chance"]


def _retrieval_status(row: Mapping[str, Any]) -> tuple[str, str]:
    """Status of "removing these heads drops retrieval to chance, random heads do not"."""
    if not _does(row):
        return UNTESTABLE, "the model is at chance on this task before any ablation"
    if effect(row["change"]) != "negative":
        return NOT, "the accuracy change's interval includes 0"
    vs = row.get("vs_random")
    if vs is not None:
        if effect(vs) != "negative":
            return NOT, "the drop minus random heads' drop has an interval that includes 0"
        p = row.get("p_adjusted", row.get("p_value"))
        if p is not None and p >= 0.05:
            return NOT, f"the drop beats random heads only before correction (Holm p = {p:.2g})"
        beats = "beats random heads (interval and Holm p < 0.05)"
    else:
        rand = row.get("random_change")
        if rand is None or not rand["low"] > row["change"]["high"]:
            return NOT, "no random-head comparison whose interval separates from the drop"
        beats = "below random heads' interval"
    if row["after"]["low"] <= row["chance"]:
        return REPRODUCED, f"drop excludes 0, {beats}, after-accuracy reaches chance"
    return PARTLY, f"drop excludes 0 and {beats}, but accuracy stays above chance"


def _flat_status(row: Mapping[str, Any]) -> tuple[str, str]:
    """Status of "this knowledge task stays flat"."""
    if not _does(row):
        return UNTESTABLE, "the model is at chance on this task before any ablation"
    verdict = within_margin(row["change"], FLAT_POINTS)
    ceiling = " (at the 100% ceiling)" if row["before"]["value"] >= 1.0 else ""
    margin = f"+-{100 * FLAT_POINTS:.0f}"
    if verdict == "within":
        return REPRODUCED, f"the change's whole interval within {margin} points{ceiling}"
    if verdict == "outside":
        return NOT, f"the change's whole interval beyond {margin} points"
    return (
        INCONCLUSIVE,
        f"the change's interval crosses the {margin}-point margin: neither flat nor moved",
    )


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
    results = _holm_adjusted(results)
    out: list[dict[str, str]] = []
    if "1" in results:
        r = results["1"]
        for rem in [x for x in r["removal"] if x["k"] in (4, 8)] or r["removal"][-1:]:
            k = rem["k"]
            out += _few_heads(r["model"], f"KV top {k}", rem["rows"][0], k, rem.get("control"))
        for task, claim in (
            ("mmlu-cloze", "Knowledge (cloze MMLU) stays flat"),
            ("mmlu-letter", "MMLU in the paper's letter format falls to chance"),
            ("kv-paper-template", "KV retrieval in the paper's template falls to chance"),
        ):
            x = next((x for x in r["knowledge"]["rows"] if x["task"] == task), None)
            if x is None:
                continue
            numbers = (
                f"{_pct(x['before'])} -> {_pct(x['after'])} (chance {_share(x['chance'])}, "
                f"n={x['n']})"
            )
            verdict = _flat_status(x) if task == "mmlu-cloze" else _retrieval_status(x)
            out.append(_status(claim, r["model"], numbers, verdict))
    for r in results.get("2", []):
        rem = next((x for x in r["rows"] if x["k"] == 4), r["rows"][-1])
        row = _row(rem, r["probe"])
        status, why = _retrieval_status(row)
        cloze = _row(rem, "cloze")
        c_status, _ = _flat_status(cloze)
        if status == REPRODUCED and c_status != REPRODUCED:
            status, why = PARTLY, why + f"; but cloze is not shown flat ({c_status})"
        numbers = (
            f"{r['probe']} top {rem['k']}: {_pct(row['before'])} -> {_pct(row['after'])}, random "
            f"{_pts(row.get('random_change'))}; cloze {_pts(cloze['change'])}"
        )
        claim = "Retrieval falls, knowledge (cloze) stays"
        out.append(_status(claim, r["model"] + _unit_note(r), numbers, (status, why)))
    induction = {
        x["head"]: x["prefix_matching"]
        for x in (results.get("7") or {}).get("question_induction", [])
    }
    for r in ([results["1"]] if "1" in results else []) + list(results.get("2", [])):
        if r.get("top_heads"):  # prefix-matching scores are SmolLM2's (finding 1)
            known = induction if r is results.get("1") else None
            out.append(_roles_status(r["model"], r["top_heads"][:4], known))
    if "1" in results and results["1"].get("masks"):
        r = results["1"]
        out.append(_mask_status(r["masks"] | {"model": r["model"], "task": "kv"}))
    out += [_mask_status(r) for r in results.get("3", [])]
    out += _sharpness_status(results["4"]) if "4" in results else []
    for key, model, x in _layer_results(results):
        if key == "smollm2_facts":
            model = "SmolLM2-135M, facts template (copying cannot answer it)"
        out += [_layers_status(model, x["pruning"]), _dictionary_status(model, x["dictionary"])]
    out += [_probe_status(results["7"])] if "7" in results else []
    out += _templates_status(results["8"]) if "8" in results else []
    out += _kcurve_status(results["10"]) if "10" in results else []
    out += [_hybrid_status(results["5"])] if "5" in results else []
    return out


def _layer_results(results: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, Any]]]:
    """Findings 6 and 9, the layer experiments: ``(key, model, result)`` per model, the key
    naming its figures (``"smollm2"``, ``"llama"``, ..., ``"smollm2_facts"``)."""
    if not results.get("6"):
        return []
    items = [("smollm2", "SmolLM2-135M", results["6"]["smollm2"])]
    items += [(z["model"].removeprefix("zoo-"), z["model"], z) for z in results["6"].get("zoo", [])]
    if results.get("9"):
        items.append(("smollm2_facts", "SmolLM2-135M", results["9"]))
    return items


def _decided_rows(results: Mapping[str, Any]) -> list[Any]:
    """The task rows whose p-value a status of :func:`status_rows` reads: one family."""
    rows: list[Any] = []
    if "1" in results:
        rows += [x["rows"][0] for x in results["1"]["removal"] if x["k"] in (4, 8)]
    for r in results.get("2", []):
        rem = next((x for x in r["rows"] if x["k"] == 4), r["rows"][-1])
        rows.append(_row(rem, r["probe"]))
    rows += [_row(c, f"kv-{c['selected_on']}") for c in (results.get("8") or {}).get("cells", [])]
    for cell in (results.get("10") or {}).get("cells", []):
        if cell["k"] == (results["10"].get("halves") or {}).get("kv-question", {}).get("h"):
            rows += list(cell["rows"])
    return rows


def _holm_adjusted(results: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``results`` whose decided rows carry ``p_adjusted``: Holm's correction over
    every p-value the status table decides on."""
    import copy

    out = copy.deepcopy(dict(results))
    rows = _decided_rows(out)
    for row, q in zip(rows, holm([x.get("p_value") for x in rows]), strict=True):
        if q is not None:
            row["p_adjusted"] = q
    return out


def _templates_status(r: Mapping[str, Any]) -> list[dict[str, str]]:
    """Finding 8's rows: each template's top k on its own held-out prompts (the retrieval claim)
    and on held-out prose (the set control), the facts template being the one copying cannot
    answer."""
    out = []
    for cell in r["cells"]:
        t, k = cell["selected_on"], cell["k"]
        model = f"{r['model'].split(' (')[0]}, {t} template"
        out += _few_heads(
            model, f"{t} top {k} on held-out {t} prompts", _row(cell, f"kv-{t}"), k,
            cell.get("control"), label=f"SmolLM2 {t} top {k}", copying=_copying(t),
        )  # fmt: skip
    return out


def _few_heads(
    model: str, what: str, row: Mapping[str, Any], k: int, control: Any, *, label: str = "",
    copying: str = "",
) -> list[dict[str, str]]:  # fmt: skip
    """The :data:`FEW_HEADS` row of ``k`` heads removed (``what``: which, on which prompts) and,
    given the set's ``control``, its prose row (:func:`_set_control_status`)."""
    label = label or f"SmolLM2 top {k}"
    numbers = (
        f"{what}: {_pct(row['before'])} -> {_pct(row['after'])} (chance {_share(row['chance'])}); "
        f"{k} random heads: {_pts(row.get('random_change'))}{_p_text(row)}"
    )
    out = [_status(FEW_HEADS, model + copying, numbers, _retrieval_status(row), label=label)]
    if control:
        out.append(_set_control_status(model, k, control) | {"label": f"{label} (prose)"})
    return out


def _copying(template: str) -> str:
    return " (copying cannot answer it)" if template == "facts" else " (copying answers it)"


def _halves_text(x: Mapping[str, Any]) -> str:
    h = x["h"]
    return (
        f"heads 1-{h} cost {_pts(x['first'])}, heads {h + 1}-{2 * h} a further "
        f"{_pts(x['second'])}; difference {_pts(x['first_minus_second'])}"
    )


def _kcurve_status(r: Mapping[str, Any]) -> list[dict[str, str]]:
    """Finding 10's rows: "a handful of heads, diminishing returns" on each template (the
    question template's ranking removed), and finding 1's masks on the facts template.

    Reproduced when the top ``h`` heads beat random sets of their size (:func:`_retrieval_status`
    passes or reaches partly) and the first ``h`` heads' drop exceeds the next ``h``'s,
    paired by prompt (the difference's interval above 0); inconclusive when that interval
    includes 0; not reproduced when the next ``h`` cost more, or the top ``h`` do not beat
    random sets."""
    out = []
    claim = "A handful of heads carries retrieval, with diminishing returns"
    for task, x in (r.get("halves") or {}).items():
        h = x["h"]
        cell = next((c for c in r["cells"] if c["k"] == h), None)
        row = _row(cell, task) if cell else None
        template = task.removeprefix("kv-")
        model = f"SmolLM2-135M, the question ranking on the {template} template"
        model += _copying(template)
        numbers = _halves_text(x) + (
            f"; top {h} vs random {_pts(row.get('vs_random'))}" if row else ""
        )
        first, first_why = _retrieval_status(row) if row else (NOT, "no cell of that size")
        gain = effect(x["first_minus_second"])
        if row is not None and not _does(row):
            status, why = UNTESTABLE, "the model is at chance on this task"
        elif first not in (REPRODUCED, PARTLY):
            status, why = NOT, f"the top {h} do not beat random sets of {h}: {first_why}"
        elif gain == "positive":
            status = REPRODUCED
            why = (
                f"the top {h} beat random sets, and the next {h} heads add less (the "
                "difference's interval, paired by prompt, lies above 0)"
            )
        elif gain == "negative":
            status, why = NOT, f"the next {h} heads cost more than the first {h}"
        else:
            status = INCONCLUSIVE
            why = f"the next {h} heads' added drop is not shown smaller (interval includes 0)"
        out.append(_status(claim, model, numbers, (status, why), label=f"SmolLM2 {template}"))
    if r.get("masks_facts"):
        out.append(_mask_status(r["masks_facts"] | {"model": "SmolLM2-135M, facts template",
                                                    "task": "kv-facts"}))  # fmt: skip
    return out


def _mask_status(r: Mapping[str, Any]) -> dict[str, str]:
    base, kept, denied = r["baseline"], r["kept"], r["denied"]
    numbers = (
        f"{r['task']}: no mask {_pct(base)}, kept {_pct(kept)}, denied {_pct(denied)} "
        f"(chance {_share(r['chance'])})"
    )
    row = {"claim": "Keeping only the G&A patterns keeps retrieval; denying them breaks it",
           "model": r["model"], "numbers": numbers}  # fmt: skip
    if not base["low"] > r["chance"]:
        return row | {"status": UNTESTABLE, "why": "the model is at chance on this task"}
    if "gather_heads" in r and not r["gather_heads"] and not r.get("aggregate_heads"):
        return row | {"status": NO_RESULT, "why": "no candidate pair to mask: no gather candidate "
                      "sits in a layer below an aggregate candidate (pair_candidates)"}  # fmt: skip
    if base["value"] == kept["value"] == denied["value"]:
        return row | {"status": NO_RESULT, "why": "kept, denied and no mask give the same "
                      "accuracy: the masks changed no answer, so the experiment cannot tell"}  # fmt: skip
    keeps = kept["value"] >= base["value"] - FLAT_POINTS * 2 and kept["high"] >= base["low"]
    breaks = denied["high"] < base["low"]
    if keeps and breaks:
        status, why = REPRODUCED, "kept within 10 points of no mask, denied's interval below it"
    elif breaks:
        status, why = PARTLY, "denying hurts (interval below no mask's) but keeping also does"
    elif keeps:
        status = NOT
        why = (
            "denying the patterns does not lower accuracy beyond its interval, so keeping them "
            "shows nothing"
        )
    else:
        status, why = NOT, "neither holds"
    return row | {"status": status, "why": why}


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
        why = (
            "the zoo Transformer does not do KV retrieval, so there is no Transformer baseline to "
            "compare the SSMs' sharpness or capacity with"
        )
        verdict = UNTESTABLE, why
    else:
        t = sharp[transformer]["mean_sharpness"]
        less = [m for m in ssms if does[m] and sharp[m]["mean_sharpness"]["high"] < t["low"]]
        status = REPRODUCED if less and len(less) == sum(does[m] for m in ssms) else NOT
        verdict = status, "sharpness intervals of the SSMs' top heads vs the Transformer's"
    return [_status(claim, "zoo", numbers, verdict)]


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
    by_kind = r.get("masking_by_kind") or {}
    attn = by_kind.get("attention")
    if attn:
        numbers += (
            f"; denying only the attention candidates': kv-8 {_pct(attn['baseline'])} -> "
            f"{_pct(attn['denied'])}"
        )
    ssm = by_kind.get("ssm")
    if ssm:
        numbers += f"; only the SSM candidates': {_pct(ssm['denied'])}"
    base = {"claim": claim, "model": r["model"], "numbers": numbers}
    if not kv["baseline"]["low"] > kv["chance"]:
        return base | {"status": UNTESTABLE, "why": "the hybrid does not do KV retrieval"}
    if "attention" not in kinds or not attn:
        return base | {"status": NOT, "why": "its top aggregate candidates are all SSM heads"}
    if not attn["denied"]["high"] < attn["baseline"]["low"]:
        return base | {
            "status": NOT,
            "why": "denying the attention candidates' aggregate patterns does not lower kv-8 "
            "beyond its interval: the measurement does not show attention aggregating",
        }
    if kinds[0] == "attention":
        return base | {"status": REPRODUCED, "why": "the top aggregate head is attention, and "
                       "denying the attention candidates' patterns lowers kv-8 beyond its "
                       "interval"}  # fmt: skip
    return base | {
        "status": PARTLY,
        "why": "denying the attention candidates' patterns lowers kv-8, but the top aggregate "
        "candidate is an SSM head",
    }


#: Prefix-matching score above which a head counts as an induction head (chance is about 0.01).
INDUCTION = 0.5


def _roles_status(
    model: str, heads: Sequence[Mapping[str, Any]], induction: Mapping[str, float] | None = None
) -> dict[str, str]:
    """Status of "the top heads gather and aggregate" from the pattern roles of the top heads
    (a role needs its score above its null, see :mod:`gna_lens.scoring.patterns`). Where the
    heads' prefix-matching scores are known (``induction``) and every gather is an induction
    head, the gather role is not credited in full: on a template that copying answers, an
    induction head's pattern can look like gathering.

    Examples:
        >>> _roles_status("m", [{"head": "L1H0", "role": "gather"}, {"head": "L2H0", "role": "-"}])["status"]
        'partly'
    """
    roles = {h["head"]: h.get("role") or "-" for h in heads}
    gather = [h for h, r in roles.items() if "gather" in r]
    aggregate = [h for h, r in roles.items() if "aggregate" in r]
    numbers = ", ".join(f"{h} {r}" for h, r in roles.items())
    base = {"claim": "The top heads gather and aggregate (their patterns)", "model": model,
            "numbers": f"top {len(heads)}: {numbers}"}  # fmt: skip
    copying = [h for h in gather if (induction or {}).get(h, 0.0) >= INDUCTION]
    if copying:
        base["numbers"] += "; prefix matching " + ", ".join(
            f"{h} {induction[h]:.2f}" for h in copying if induction
        )
    if gather and aggregate and len(copying) == len(gather):
        return base | {"status": PARTLY, "why": "a gather and an aggregate pattern among them, "
                       f"but every gather is an induction head (prefix matching >= {INDUCTION})"}  # fmt: skip
    if gather and aggregate:
        return base | {"status": REPRODUCED, "why": "a gather and an aggregate pattern among them"}
    if gather or aggregate:
        return base | {"status": PARTLY, "why": "only one of the two roles among them"}
    return base | {"status": NOT, "why": "no gather or aggregate pattern among them"}


def _layers_status(model: str, p: Mapping[str, Any]) -> dict[str, str]:
    """Layer removal: a few single layers carry retrieval (accuracy change below 0 with its
    interval *and* after Holm's correction over the layers, p-values from the intervals; the
    control's whole interval below :data:`~gna_lens.findings.rules.FLAT_NATS`) while most do
    not."""
    singles = p.get("individual", [])
    adjusted = holm([interval_p_value(x["change"]) for x in singles])
    hit = [
        x
        for x, q in zip(singles, adjusted, strict=True)
        if effect(x["change"]) == "negative"
        and q is not None
        and q < 0.05
        and within_margin(x["control_change"], FLAT_NATS, two_sided=False) == "within"
    ]
    uncorrected = [x for x in singles if effect(x["change"]) == "negative" and x not in hit]
    n = len(singles)
    names = " ".join(f"L{x['layer']}" for x in hit) or "none"
    lost = " ".join(f"L{x['layer']}" for x in uncorrected)
    lost = f"; below 0 before correction or with the control not flat: {lost}" if lost else ""
    base = {"claim": "Layer removal: a few layers carry retrieval while the rest hold the "
            "knowledge", "model": model,
            "numbers": f"{len(hit)} of {n} layers alone lower retrieval (Holm over {n} layers) "
            f"with the control's interval below {FLAT_NATS} ({names}){lost}"}  # fmt: skip
    if not p.get("baseline") or not p["baseline"]["low"] > p["chance"]:
        return base | {"status": UNTESTABLE, "why": "the model is at chance on the task"}
    if hit and len(hit) <= max(2, n // 4):
        return base | {"status": REPRODUCED, "why": "a few single layers, control flat"}
    if hit:
        return base | {"status": PARTLY, "why": "more than a quarter of the layers do"}
    return base | {"status": NOT, "why": "no single layer does"}


def _dictionary_status(model: str, d: Mapping[str, Any]) -> dict[str, str]:
    """Dictionary size: removing the top heads *as a set* costs more than random sets at every
    size (interval below 0 and Holm-adjusted p < 0.05 over the sizes). This is a set-level
    claim; the slides' per-head claim has no experiment here (see :data:`SEED_CLAIMS`)."""
    rows = [x for x in d.get("points", []) if x.get("vs_random")]
    done = [x for x in rows if x["before"]["low"] > x["chance"]]
    adjusted = holm([x.get("p_value", interval_p_value(x["vs_random"])) for x in done])
    worse = [
        x
        for x, q in zip(done, adjusted, strict=True)
        if effect(x["vs_random"]) == "negative" and (q is None or q < 0.05)
    ]
    sizes = (
        ", ".join(f"{x['n_pairs']}: {_pts(x['vs_random'])}" for x in done) or "no size above chance"
    )
    base = {"claim": "Removing the top heads costs more than random heads at every dictionary "
            "size", "model": model, "numbers": f"top minus random, per size: {sizes}"}  # fmt: skip
    if not done:
        return base | {"status": UNTESTABLE, "why": "the model is at chance at every size"}
    if len(worse) == len(done):
        return base | {"status": REPRODUCED, "why": "every interval below 0"}
    if worse:
        return base | {"status": PARTLY, "why": "at some sizes only"}
    return base | {"status": NOT, "why": "at no size"}


def _probe_status(r: Mapping[str, Any]) -> dict[str, str]:
    """The probe needs gathering, not copying: on a template induction cannot answer, the
    model does the task and the ranking finds the same heads."""
    acc = r["accuracy"]
    k = len(r["question_top"]) or len(r["top_heads"])
    base = {"claim": "Induction cannot answer the probe, and it finds the same heads",
            "model": r["model"],
            "numbers": f"{r['template']}: {_pct(acc)} (chance {_share(r['chance'])}); top "
            f"{len(r['top_heads'])} shares {len(r['overlap'])} of the question template's "
            f"top {k}"}  # fmt: skip
    if not acc["low"] > r["chance"]:
        return base | {"status": UNTESTABLE, "why": "the model is at chance on the facts probe"}
    if len(r["overlap"]) * 2 >= k:
        return base | {"status": REPRODUCED, "why": "at least half the top heads shared"}
    if r["overlap"]:
        return base | {"status": PARTLY, "why": "fewer than half the top heads shared"}
    return base | {"status": NOT, "why": "no top head shared"}


def _p_text(row: Mapping[str, Any]) -> str:
    """``"; vs random -47.0 points [-60.0, -33.3], p <= 1.0e-04 (the floor of 10,000 sign
    flips)"`` (with the Holm-adjusted value where it differs) or ``""``."""
    vs = row.get("vs_random")
    if not vs:
        return ""
    return f"; vs random {_pts(vs)}, {p_text(row.get('p_value'), adjusted=row.get('p_adjusted'))}"


def _set_control_status(model: str, k: int, ctrl: Mapping[str, Any]) -> dict[str, str]:
    """Status of "text that needs no retrieval stays flat" for the set of ``k`` heads removed
    together, an equivalence test at :data:`~gna_lens.findings.rules.FLAT_NATS`: reproduced
    when the whole interval of the set's prose cost lies below the margin; partly when it does
    not, but its excess over as many random heads (paired by window) does (the cost is what any
    such set costs); not reproduced when the cost or its excess lies wholly above the margin;
    inconclusive otherwise."""
    change, vs = ctrl["change"], ctrl.get("vs_random")
    own = within_margin(change, FLAT_NATS, two_sided=False)
    excess = within_margin(vs, FLAT_NATS, two_sided=False) if vs else None
    if own == "within":
        status, why = REPRODUCED, f"the set's joint change lies below {FLAT_NATS} nats/token"
    elif excess == "within" and effect(change) == "positive":
        status = PARTLY
        why = (
            f"the set costs prose (interval above 0, crossing {FLAT_NATS}), but no more than "
            f"random sets of its size: the excess's interval lies below {FLAT_NATS}"
        )
    elif own == "outside" and excess in (None, "outside"):
        status, why = NOT, f"the set's joint change lies above {FLAT_NATS} nats/token"
    else:
        status = INCONCLUSIVE
        why = f"the interval crosses the {FLAT_NATS} nats/token margin" + (
            "" if vs else "; no paired comparison with random sets was stored"
        )
    vs_text = f"; minus random, paired by window {_nats(vs)}" if vs else ""
    numbers = (
        f"top {k}: prose loss {_nats(ctrl['change'])} nats/token (n={ctrl.get('n', '?')} "
        f"windows); random {_nats(ctrl.get('random_change'))}{vs_text}"
    )
    claim = "...while text that needs no retrieval stays flat (the set removed together)"
    return _status(claim, model, numbers, (status, why))


def _summary(rows: Sequence[Mapping[str, str]]) -> tuple[str, str]:
    """One status for several rows: reproduced (or not reproduced) only when every testable row
    says so, partly when they differ; rows that cannot test or cannot decide the claim (not
    testable, inconclusive: an interval across its margin, e.g. the same set measured on fewer
    prose windows) count only when no row decides. The text lists every row's status.

    Examples:
        >>> _summary([{"model": "a", "status": "reproduced"}, {"model": "b", "status": "not reproduced"}])
        ('partly', 'a: reproduced; b: not reproduced')
    """
    got = [r["status"] for r in rows]
    testable = [x for x in got if x in (REPRODUCED, PARTLY, NOT)]
    if not testable:
        status = INCONCLUSIVE if INCONCLUSIVE in got else NO_RESULT if NO_RESULT in got else got[0]
    elif all(x == REPRODUCED for x in testable):
        status = REPRODUCED
    elif all(x == NOT for x in testable):
        status = NOT
    else:
        status = PARTLY
    detail = "; ".join(
        f"{r.get('label') or r['model'].split(' (')[0]}: {r['status']}" for r in rows
    )
    return status, detail


def _swap_status(swap: Mapping[str, Any] | None) -> tuple[str, str]:
    if not swap:
        return NOT_ATTEMPTED, "no swap_heads result found (docs/assets/hybrid_swap_zoo.json)"
    rand = swap["paired_kv16"]["mean of the random swaps"]
    text = (
        f"zoo-mamba2, top head swapped for attention and trained, minus random swaps on kv-16: "
        f"{_pts(rand)}"
    )
    if effect(rand) == "positive":
        return REPRODUCED, text + " (excludes 0)"
    if effect(rand) == "negative":
        return NOT, text + " (below 0)"
    return INCONCLUSIVE, text + " (the interval includes 0: no effect shown either way)"


def _students_status(
    st: Mapping[str, Any] | None, controlled: Mapping[str, Any] | None = None
) -> tuple[str, str]:
    """The retrieval-guided hybrid claim: top-k students against random-k students. The
    controlled run (no-KV distillation data, several layer-matched random students, seeds)
    decides when present; the first, uncontrolled run alone can grant *partly* at most."""
    if controlled:
        return _controlled_students_status(controlled, st)
    if not st:
        return NOT_ATTEMPTED, "no hybrid-student result found (docs/assets/hybrid_smollm2_*.json)"
    comps = st["comparisons"]
    above = all(c["paired_random"]["low"] > 0 for c in comps)
    sizes = ", ".join(f"{c['task']} {_pts(c['paired_random'])}" for c in comps)
    text = f"SmolLM2 students, top-{comps[0]['k']} minus random-{comps[0]['k']}: {sizes}"
    if not above:
        return NOT, text
    return PARTLY, text + (
        "; uncontrolled: the distillation data held KV texts, one random student, one training seed"
    )


def set_level_comparisons(ctl: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The controlled hybrid run's top-k students against its random-k students *as head sets*.

    Per data arm and task: each random head set's per-prompt correctness (averaged over the
    training seeds that distilled it) is compared, prompt by prompt, with the top-k students'
    (averaged over seeds); the interval is :func:`~gna_lens.stats.two_level_interval` over the
    random sets and the prompts, so it covers which sets were drawn; ``p_set`` is the exact
    one-sided set-level permutation p-value (the top set ranked among the ``n_sets + 1`` sets
    by mean accuracy), whose floor is ``1 / (n_sets + 1)``. Empty when the rows hold no
    per-prompt results.
    """
    import torch

    from gna_lens.device import HOST
    from gna_lens.stats import two_level_interval

    rows = [r for r in ctl.get("rows", []) if r.get("kv_correct")]
    out = []
    for data in dict.fromkeys(r.get("data") for r in rows if r.get("kind") == "top"):
        arm = [r for r in rows if r.get("data") == data]
        tops = [r for r in arm if r["kind"] == "top"]
        sets: dict[tuple[tuple[int, int], ...], list[Mapping[str, Any]]] = {}
        for r in arm:
            if r["kind"] == "random":
                sets.setdefault(tuple(tuple(h) for h in r["heads"]), []).append(r)
        if not tops or not sets:
            continue

        def correct(rows: list[Mapping[str, Any]], task: str) -> torch.Tensor:
            """``[students, prompts]`` correctness, on the host."""
            return torch.tensor(
                [r["kv_correct"][task] for r in rows], dtype=torch.float64, device=HOST
            )

        # a task added later is measured by the students trained since: each task on its own
        for task in dict.fromkeys(t for r in tops for t in r["kv_correct"]):
            tops_t = [r for r in tops if task in r["kv_correct"]]
            groups = [[r for r in g if task in r["kv_correct"]] for g in sets.values()]
            groups = [g for g in groups if g]
            if not groups:
                continue
            top = correct(tops_t, task)
            rand = torch.stack([correct(g, task).mean(0) for g in groups])  # [sets, prompts]
            diff = top.mean(0)[None] - rand
            top_mean = float(top.mean())
            at_least = sum(float(x.mean()) >= top_mean for x in rand)
            out.append(
                {
                    "data": data,
                    "task": task,
                    "k": tops[0]["k"],
                    "n_sets": len(groups),
                    "seeds": sorted({r.get("seed", 0) for g in [tops_t, *groups] for r in g}),
                    "vs_random": two_level_interval(diff).to_dict(),
                    "p_set": (1 + at_least) / (len(groups) + 1),
                    "p_floor": 1 / (len(groups) + 1),
                }
            )
    return out


def _controlled_students_status(
    ctl: Mapping[str, Any], first: Mapping[str, Any] | None
) -> tuple[str, str]:
    sets = set_level_comparisons(ctl)
    comps = sets or [c for c in ctl.get("comparisons", []) if "paired_random_mean" in c]
    arms, verdicts = [], []
    significant = bool(sets)
    for data in dict.fromkeys(c["data"] for c in comps):
        group = [c for c in comps if c["data"] == data]
        k = group[0]["k"]
        seeds = ", ".join(str(x) for x in group[0]["seeds"])
        if sets:
            ivs = [c["vs_random"] for c in group]
            n = group[0]["n_sets"]
            sizes = ", ".join(
                f"{c['task']} {_pts(c['vs_random'])} (set-level p = {c['p_set']:.2g}, floor "
                f"{c['p_floor']:.2g}" + (f"; {c['n_sets']} sets" if c["n_sets"] != n else "") + ")"
                for c in group
            )
            significant &= all(c["p_set"] < 0.05 for c in group)
            what = (
                f"{n} distinct layer-matched random-{k} head sets), top-{k} minus the random "
                "sets, interval over sets and prompts"
            )
        else:
            ivs = [c["paired_random_mean"] for c in group]
            n = group[0].get("n_random", 0)
            sizes = ", ".join(f"{c['task']} {_pts(c['paired_random_mean'])}" for c in group)
            what = (
                f"{n} layer-matched random-{k}), top-{k} minus the random students' mean "
                "(interval over prompts only: no per-prompt results stored)"
            )
        arms.append(f"{data} data (seed {seeds}; {what}: {sizes}")
        positive = sum(effect(x) == "positive" for x in ivs)
        verdicts.append("all" if positive == len(ivs) else "some" if positive else "none")
    pending = ctl.get("method", {}).get("pending") or []
    text = "SmolLM2 students, controlled run: " + "; ".join(arms or ["no comparison yet"])
    if "heads are the joint set" not in str(ctl.get("method", {}).get("ranking", "")):
        text += (
            "; the top-k students keep the per-head top k, not the joint set (this run's "
            "ranking predates the joint walk; the joint set would change every student)"
        )
    rows = ctl.get("rows", [])
    none = [r for r in rows if r.get("kind") == "none" and r.get("kv")]
    if none:
        text += "; k = 0 students (no attention head): " + ", ".join(
            f"{r['name']} " + " / ".join(f"{t} {_pct(v)}" for t, v in r["kv"].items()) for r in none
        )
    else:
        text += "; no k = 0 student in this run"
    teacher = next((r for r in rows if r.get("kind") == "teacher"), None)
    tops = [r for r in rows if r.get("kind") == "top" and r.get("knowledge")]
    knowledge_kept = True
    if teacher and teacher.get("knowledge") and tops:
        t = teacher["knowledge"]
        # kept: every top-k student within reach of the teacher *and* above chance (a student
        # at chance overlaps a weak teacher's interval without keeping anything)
        chance = (ctl.get("chance") or {}).get(ctl.get("knowledge_task") or "", 0.0)
        below = [r for r in tops if r["knowledge"]["high"] < t["low"]]
        at_chance = [r for r in tops if r["knowledge"]["low"] <= chance]
        knowledge_kept = not below and not at_chance
        why = " (below the teacher's interval: not kept)" if below else ""
        if at_chance and not below:
            why = f" (interval reaches chance {100 * chance:.0f}%: not kept)"
        text += (
            f"; knowledge (MMLU cloze): teacher {_pct(t)}, top-k students "
            + ", ".join(f"{r['name']} {_pct(r['knowledge'])}" for r in tops)
            + why
        )
    copying_only = False
    facts = [t for t in ctl.get("kv_tasks") or [] if t.endswith("-facts")]
    if teacher and facts:
        chance = ctl.get("chance") or {}
        measured = [
            r for r in rows if r.get("kind") == "top" and all(t in r.get("kv", {}) for t in facts)
        ]
        text += "; facts template (copying cannot answer it): teacher " + " / ".join(
            f"{t} {_pct(teacher['kv'][t])}" for t in facts if t in teacher.get("kv", {})
        )
        if measured:
            text += ", top-k students " + ", ".join(
                f"{r['name']} " + " / ".join(_pct(r["kv"][t]) for t in facts) for r in measured
            )
            above = [t for t in facts if teacher["kv"][t]["low"] > chance.get(t, 0.0)]
            copying_only = bool(above) and all(
                r["kv"][t]["low"] <= chance.get(t, 0.0) for r in measured for t in above
            )
            if copying_only:
                text += (
                    " (each of these students' intervals reaches chance where the teacher's lies "
                    "above it: the retrieval the students recover is what copying does)"
                )
        else:
            text += "; no top-k student measured on it yet"
    if pending:
        text += f"; not distilled yet: {', '.join(pending)}"
    if first and not any(c["data"] == "default" for c in comps):
        text += "; default data, first run (one uniform random student): " + ", ".join(
            f"{c['task']} {_pts(c['paired_random'])}" for c in first.get("comparisons", [])
        )
    if not verdicts or all(v == "none" for v in verdicts):
        return NOT, text
    if sets and not significant:
        text += (
            "; no set-level p-value below 0.05 (with this few random sets it cannot be: the "
            "floor is 1 / (sets + 1))"
        )
    if (
        all(v == "all" for v in verdicts)
        and not pending
        and knowledge_kept
        and not copying_only
        and (significant or not sets)
    ):
        return REPRODUCED, text
    return PARTLY, text


#: Every claim of the paper's abstract and slides (``../shared/seeds``): ``(claim, source, key)``;
#: ``key`` picks the status rows that measure it, or says why none does.
SEED_CLAIMS: tuple[tuple[str, str, str], ...] = (
    ("In-context retrieval concentrates in a few heads: removing them drops retrieval to "
     "chance; as many random heads do not", "abstract; slides (ablation tables)", "few-heads"),
    ("Text that needs no retrieval stays flat when they are removed",
     "abstract; slides (knowledge column)", "flat-prose"),
    ("Knowledge tasks stay flat when they are removed", "abstract; slides (knowledge column)",
     "flat-knowledge"),
    ("Disabling one Gather or Aggregate head drops MMLU's answer letter to chance (pruned "
     "Llama-3.1-8B: 66% -> 25%)", "abstract; slides (heads kept per layer)", "letter"),
    ("MMLU is more retrieval than knowledge: with G&A intact the pruned model passes MMLU yet "
     "fails other knowledge tests", "abstract; slides", "untestable:the paper's pruned "
     "Llama-3.1-8B and the knowledge benchmarks (ARC, PIQA, WinoGrande, OpenBookQA, HellaSwag) "
     "are not installable offline; SmolLM2-135M is at chance on MMLU's letter format"),
    ("The bottleneck extends to GSM8K, BBH, SWDE, LAMBADA and dialogue", "abstract; slides "
     "(benchmark battery)", "untestable:the lm-eval backend (gna_lens.lm_eval) runs these "
     "tasks, but their datasets come from the Hugging Face hub, which is unreachable here"),
    ("Format triggers retrieval: removing G&A heads hurts ARC-Challenge in chat mode more than "
     "in completion mode", "slides (ARC chat vs regular)", "untestable:ARC-Challenge is not "
     "installable offline (no registry package ships it)"),
    ("Gradual pruning from the end: knowledge is spread over layers, but one or two middle "
     "layers carry retrieval (removing them alone harms MMLU)", "slides (gradual and individual "
     "pruning)", "layers"),
    ("Per head, dictionary size separates the roles: one head's removal costs a constant drop, "
     "another's grows with the dictionary", "slides (KV with growing dictionary)",
     "attempted-not:no per-head dictionary curves were run (each top head alone vs random single "
     "heads); finding 6's curves remove the top 4 as a set (status table: 'Removing the top heads "
     "costs more'), which tests a different claim"),
    ("A handful of heads carries retrieval, with diminishing returns past the top 10-20",
     "slides (heads kept)", "k-curve"),
    ("A Gather head condenses each segment into its last token; an Aggregate head reads those "
     "tokens at the final position", "abstract; slides (G&A patterns)", "roles"),
    ("SSMs develop G&A too: keeping only the G&A patterns keeps retrieval, denying them breaks "
     "it", "slides (masking)", "masks"),
    ("SSM G&A is smoother (less sharp), and SSM retrieval falls faster with dictionary size",
     "abstract; slides", "sharpness"),
    ("SSM G&A is more redundant: SSMs are less sensitive to ablating their G&A heads",
     "slides (Llama-3B vs Llamba-3B)", "untestable:the paper's pair (Llama-3.2-3B and its "
     "distilled SSM Llamba-3B) needs the Hugging Face hub, which is unreachable here; gna_lens "
     "loads Llamba and `gna-lens evaluate` runs the comparison where the hub is reachable "
     "(docs/recipes/llama_vs_llamba.md); no Transformer and SSM here share a retrieval task both "
     "do well (zoo-llama does letter-MC, not KV), so the zoo's drops are not comparable"),
    ("Pretrained hybrids hand the Aggregate role to attention", "abstract; slides", "hybrid"),
    ("Replacing one G&A head of a pretrained SSM by attention boosts retrieval", "abstract; "
     "slides (layer-to-layer distillation)", "swap"),
    ("Keeping a handful of G&A heads as attention in a distilled hybrid recovers retrieval "
     "(KV 13% -> 99% with 10 heads), knowledge unchanged", "slides (retrieval-guided hybrids)",
     "students"),
    ("With attention doing retrieval, a small SSM state suffices (state 4 / 8 / 64)",
     "slides (state size)", "attempted-not:no state-size sweep of distilled students was run "
     "(gna_lens.models.state.state_bytes reports the sizes, not the accuracies)"),
)  # fmt: skip


def _zoo_knowledge_rows(results: Mapping[str, Any]) -> list[dict[str, str]]:
    """Per zoo model, whether its cloze split (knowledge from the weights) stays flat when its
    top 4 heads are removed (the numbers are in the "Retrieval falls" rows)."""
    out = []
    for r in results.get("2", []):
        rem = next((x for x in r["rows"] if x["k"] == 4), r["rows"][-1])
        status, _ = _flat_status(_row(rem, "cloze"))
        out.append({"model": r["model"], "label": f"{r['model']} (cloze)", "status": status})
    return out


def seed_claims(
    results: Mapping[str, Any], statuses: Sequence[Mapping[str, str]] | None = None
) -> list[dict[str, str]]:
    """A status for every claim in the seeds: from the measured rows, or why none measures it.

    Examples:
        >>> rows = seed_claims({})
        >>> len(rows) == len(SEED_CLAIMS), rows[4]["status"]
        (True, 'not testable offline')
    """
    statuses = list(statuses if statuses is not None else status_rows(results))

    def rows(prefix: str) -> list[Mapping[str, str]]:
        return [r for r in statuses if r["claim"].startswith(prefix)]

    pick = {
        "few-heads": rows("Removing a few heads") + rows("Retrieval falls"),
        "flat-prose": rows("...while text"),
        "flat-knowledge": rows("Knowledge (cloze MMLU)") + _zoo_knowledge_rows(results),
        "letter": rows("MMLU in the paper's letter format"),
        "layers": rows("Layer removal"),
        "roles": rows("The top heads gather") + rows("Induction cannot"),
        "masks": rows("Keeping only the G&A patterns"),
        "sharpness": rows("SSM G&A heads are less sharp"),
        "hybrid": rows("In the hybrid"),
        "k-curve": rows("A handful of heads"),
    }
    external = results.get("external", {})
    out = []
    for claim, source, key in SEED_CLAIMS:
        if key.startswith("untestable:"):
            status, why = UNTESTABLE, key.split(":", 1)[1]
        elif key.startswith("attempted-not:"):
            status, why = NOT_ATTEMPTED, key.split(":", 1)[1]
        elif key == "swap":
            status, why = _swap_status(external.get("swap"))
        elif key == "students":
            status, why = _students_status(
                external.get("students"), external.get("students_controlled")
            )
        elif pick.get(key):
            status, why = _summary(pick[key])
            why = "see the status table: " + why
        else:
            status, why = NOT_ATTEMPTED, "no experiment of this run measured it"
        out.append({"claim": claim, "source": source, "status": status, "why": why})
    return out


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
