"""The verdict rules (gna_lens.findings.rules) on the stored cases that the earlier, point-estimate
rules got wrong (issue 39). Each case below was granted a kinder status before; each assertion
fails on those rules."""

from gna_lens.findings.rules import holm, interval_p_value, p_text, within_margin
from gna_lens.findings.status import (
    _flat_status,
    _layers_status,
    _mask_status,
    _retrieval_status,
    _set_control_status,
    _swap_status,
    seed_claims,
    status_rows,
)
from gna_lens.stats import wilson_interval


def iv(value, low, high, n=60):
    return {"value": value, "low": low, "high": high, "n": n}


def acc(p, n=60):
    return wilson_interval(p * n, n).to_dict()


def test_an_interval_that_crosses_the_margin_is_inconclusive_not_flat():
    # SmolLM2's top 8, held-out prose: +0.054 [-0.033, +0.139] at the 0.1 bound ("reproduced")
    top8 = {"change": iv(0.054, -0.033, 0.139, 8), "random_change": iv(0.048, 0.002, 0.099, 80)}
    row = _set_control_status("SmolLM2", 8, top8)
    assert row["status"] == "inconclusive", row
    assert within_margin(top8["change"], 0.1, two_sided=False) == "inconclusive"
    # inside the margin: flat; wholly above: not reproduced
    assert _set_control_status("m", 4, {"change": iv(0.03, 0.01, 0.06, 64)})["status"] == (
        "reproduced"
    )
    assert _set_control_status("m", 8, {"change": iv(0.3, 0.2, 0.4, 64)})["status"] == (
        "not reproduced"
    )


def test_a_set_that_costs_what_random_sets_cost_is_partly_not_flat():
    ctrl = {
        "change": iv(0.15, 0.05, 0.25, 64),
        "random_change": iv(0.12, 0.04, 0.2, 640),
        "vs_random": iv(0.03, -0.02, 0.08, 640),
    }
    row = _set_control_status("m", 8, ctrl)
    assert row["status"] == "partly" and "no more than random" in row["why"]
    assert "minus random" in row["numbers"]


def test_a_null_is_not_partly():
    # the head swap: +5.8 [-0.5, +11.9] points was "partly" for its point estimate above 0
    swap = {"paired_kv16": {"mean of the random swaps": iv(0.058, -0.005, 0.119)}}
    assert _swap_status(swap)[0] == "inconclusive"
    assert _swap_status({"paired_kv16": {"mean of the random swaps": iv(0.1, 0.02, 0.2)}})[0] == (
        "reproduced"
    )


def test_keeping_the_patterns_counts_only_when_denying_them_hurts():
    def masks(base, kept, denied, n=60):
        return {"model": "m", "task": "kv", "chance": 1 / 6, "baseline": acc(base, n),
                "kept": acc(kept, n), "denied": acc(denied, n)}  # fmt: skip

    # zoo-llama: denied = no mask (90.7%), kept 92.9%: was "partly (keeping works)"
    llama = _mask_status(masks(0.9071, 0.9286, 0.9071, 140) | {"chance": 0.25})
    assert llama["status"] == "not reproduced" and "shows nothing" in llama["why"]
    # SmolLM2: denied 70.0% [57.5, 80.1] vs 76.7% unmasked, kept 78.3%
    assert _mask_status(masks(0.7667, 0.7833, 0.70))["status"] == "not reproduced"
    assert _mask_status(masks(0.9, 0.9, 0.3))["status"] == "reproduced"
    assert _mask_status(masks(0.9, 0.5, 0.3))["status"] == "partly"  # denying hurts


def test_knowledge_flat_needs_the_whole_interval_inside_five_points():
    row = {"before": acc(0.6), "chance": 0.25, "change": iv(-0.02, -0.1, 0.06)}
    assert _flat_status(row)[0] == "inconclusive"  # was "reproduced": the interval holds 0
    assert _flat_status(row | {"change": iv(0.0, -0.03, 0.03)})[0] == "reproduced"
    assert _flat_status(row | {"change": iv(-0.2, -0.3, -0.1)})[0] == "not reproduced"


def test_beating_random_heads_is_judged_on_the_paired_interval_and_holm():
    base = {"before": acc(0.77), "after": acc(0.2), "chance": 1 / 6,
            "change": iv(-0.57, -0.69, -0.42), "random_change": iv(-0.3, -0.6, 0.0)}  # fmt: skip
    # point estimates: the drop is < 2x random's... but judged on the paired interval now
    assert _retrieval_status(base | {"vs_random": iv(-0.27, -0.4, -0.1), "p_value": 1e-4})[0] == (
        "reproduced"
    )
    # 2x random heads on point estimates, but the set-level interval reaches 0: not shown
    wide = base | {"random_change": iv(-0.1, -0.5, 0.0), "vs_random": iv(-0.47, -0.9, 0.02)}
    assert _retrieval_status(wide | {"p_value": 0.001})[0] == "not reproduced"
    # significant alone, not after Holm's correction
    assert (
        _retrieval_status(
            base | {"vs_random": iv(-0.2, -0.3, -0.1), "p_value": 0.02, "p_adjusted": 0.08}
        )[0]
        == "not reproduced"
    )


def test_single_layers_need_holm_over_the_layers():
    # SmolLM2's L17: -16.7 [-28.3, -6.7] points, the control +0.058 [0.017, 0.094]: the only
    # layer below 0, which fails a correction over 30 layers (was "reproduced")
    flat = iv(0.0, -0.05, 0.05)
    singles = [
        {"layer": i, "change": flat, "control_change": iv(0.01, 0.0, 0.02)} for i in range(29)
    ]
    singles.append(
        {
            "layer": 17,
            "change": iv(-0.167, -0.283, -0.067),
            "control_change": iv(0.058, 0.017, 0.094),
        }
    )
    p = {"baseline": acc(0.77), "chance": 1 / 6, "individual": singles}
    row = _layers_status("SmolLM2", p)
    assert row["status"] == "not reproduced" and "L17" in row["numbers"], row
    strong = [*singles[:-1], dict(singles[-1], change=iv(-0.5, -0.6, -0.4))]
    assert _layers_status("m", p | {"individual": strong})["status"] == "reproduced"


def test_holm_and_p_value_floor():
    assert holm([0.01, None, 0.04, 0.03]) == [0.03, None, 0.06, 0.06]
    assert holm([]) == []
    assert "floor of 10,000" in p_text(1 / 10_001)
    assert p_text(0.2) == "p = 0.2"
    assert abs(interval_p_value(iv(-1.96, -3.92, 0.0)) - 0.05) < 1e-3


def test_the_status_table_adjusts_p_values_across_its_rows():
    row = {"task": "kv", "chance": 1 / 6, "before": acc(0.77), "after": acc(0.3),
           "change": iv(-0.47, -0.59, -0.32), "random_change": iv(-0.01, -0.03, 0.01),
           "vs_random": iv(-0.46, -0.58, -0.31), "p_value": 0.03}  # fmt: skip
    r1 = {
        "model": "m",
        "removal": [{"k": k, "rows": [dict(row)], "control": None} for k in (4, 8)],
        "knowledge": {"rows": []},
    }
    rows = status_rows({"1": r1})
    # two decisions at p = 0.03 each: Holm 0.06, not below 0.05
    assert [s["status"] for s in rows] == ["not reproduced", "not reproduced"]
    assert "Holm 0.06" in rows[0]["numbers"]
    one = status_rows({"1": r1 | {"removal": r1["removal"][:1]}})
    assert one[0]["status"] == "partly"


def test_the_per_head_dictionary_claim_is_not_credited_to_a_set_level_row():
    claims = {c["claim"][:40]: c for c in seed_claims({})}
    per_head = next(c for k, c in claims.items() if k.startswith("Per head, dictionary size"))
    assert per_head["status"] == "not attempted"
    assert any(k.startswith("A handful of heads carries retrieval") for k in claims)


def test_hybrid_students_are_compared_as_head_sets():
    """Issue 39: the prompt-only interval of the controlled hybrid run ignored which random heads
    were drawn (3 sets, the same under both seeds); the set-level one covers it, and its exact
    permutation p-value cannot go below 1 / (sets + 1)."""
    from gna_lens.findings.status import _students_status, set_level_comparisons

    def row(kind, heads, seed, correct):
        return {"name": f"{kind}{heads}{seed}", "kind": kind, "k": 1, "heads": [[0, heads]],
                "seed": seed, "data": "default", "kv_correct": {"kv-4": correct}}  # fmt: skip

    good, bad = [1] * 20, [0] * 20
    rows = [row("top", 9, s, good) for s in (0, 1)]
    rows += [row("random", h, s, bad) for h in (1, 2) for s in (0, 1)]
    rows += [row("random", 3, s, good) for s in (0, 1)]  # one random set as good as the top set
    (cmp,) = set_level_comparisons({"rows": rows})
    assert cmp["n_sets"] == 3 and cmp["p_set"] == 0.5 and cmp["p_floor"] == 0.25
    assert cmp["vs_random"]["low"] <= 0 < cmp["vs_random"]["value"]  # the interval sees set 3
    status, why = _students_status(None, {"rows": rows, "comparisons": [], "method": {}})
    assert status == "not reproduced" and "set-level p = 0.5" in why
    rows[-2:] = [row("random", 3, s, bad) for s in (0, 1)]
    status, why = _students_status(None, {"rows": rows, "comparisons": [], "method": {}})
    assert status == "partly" and "floor is 1 / (sets + 1)" in why  # p = 0.25 at best


def test_finding_8_rows_judge_each_template_on_its_own_prompts_and_the_page_shows_four_cells():
    from gna_lens.findings.render import render_markdown

    def row(task, before, after, vs, p):
        return {"task": task, "n": 60, "chance": 1 / 6, "before": acc(before), "after": acc(after),
                "change": iv(after - before, after - before - 0.1, after - before + 0.1),
                "random_change": iv(-0.02, -0.06, 0.02), "vs_random": iv(*vs), "p_value": p}  # fmt: skip

    def cell(template, k, own, other, prose):
        rows = {"question": own, "facts": other} if template == "question" else {
            "question": other, "facts": own}  # fmt: skip
        return {"selected_on": template, "k": k, "heads_label": [], "rows": [
            row("kv-question", 0.77, rows["question"], (rows["question"] - 0.77, -0.7, -0.4), 1e-4),
            row("kv-facts", 0.5, rows["facts"], (rows["facts"] - 0.5, -0.5, 0.05), 0.2)],
            "control": {"n": 64, "change": iv(*prose), "random_change": iv(0.02, 0.0, 0.04),
                        "vs_random": iv(prose[0] - 0.02, prose[1] - 0.04, prose[2])}}  # fmt: skip

    r8 = {"model": "SmolLM2-135M (GGUF)", "tops": {"question": ["L1H0"], "facts": ["L2H0"]},
          "n_eval": 60, "n_prose": 64, "random_draws": 10,
          "cells": [cell("question", 4, 0.2, 0.45, (0.05, 0.02, 0.08)),
                    cell("facts", 4, 0.3, 0.6, (0.08, 0.03, 0.14))]}  # fmt: skip
    rows = [x for x in status_rows({"8": r8}) if "template" in x["model"]]
    got = {(x["label"], x["status"]) for x in rows}
    assert ("SmolLM2 question top 4", "reproduced") in got
    assert ("SmolLM2 question top 4 (prose)", "reproduced") in got
    # the facts set's own drop: its paired interval reaches 0 -> not reproduced
    assert ("SmolLM2 facts top 4", "not reproduced") in got
    assert ("SmolLM2 facts top 4 (prose)", "inconclusive") in got  # crosses 0.1
    page = render_markdown({"8": r8, "seconds": {}}, "make findings")
    assert "## 8. Which heads do retrieval that copying cannot do" in page
    assert page.count("| question top 4 |") == 2 and page.count("| facts top 4 |") == 2
    assert "| test | rule |" in page and "inconclusive" in page


def test_a_claim_is_decided_by_the_rows_that_decide_it():
    from gna_lens.findings.status import _summary

    rows = [{"model": "a", "status": "reproduced"}, {"model": "b", "status": "inconclusive"}]
    assert _summary(rows)[0] == "reproduced" and "b: inconclusive" in _summary(rows)[1]
    assert _summary(rows[1:])[0] == "inconclusive"
    assert _summary([*rows, {"model": "c", "status": "not reproduced"}])[0] == "partly"


def test_a_gather_that_is_an_induction_head_is_not_credited_in_full():
    from gna_lens.findings.status import _roles_status

    heads = [{"head": "L18H6", "role": "gather"}, {"head": "L17H2", "role": "aggregate"}]
    # SmolLM2's L18H6: the model's strongest induction head (prefix matching 0.915)
    row = _roles_status("SmolLM2", heads, {"L18H6": 0.915, "L17H2": 0.02})
    assert row["status"] == "partly" and "L18H6 0.92" in row["numbers"]
    assert _roles_status("SmolLM2", heads, {"L18H6": 0.01})["status"] == "reproduced"


def test_the_hybrid_claim_shows_the_k0_arm_or_says_it_is_missing():
    from gna_lens.findings.status import _students_status

    ctl = {"rows": [], "comparisons": [], "method": {}}
    assert "no k = 0 student" in _students_status(None, ctl)[1]
    ctl["rows"] = [{"name": "k=0", "kind": "none", "k": 0, "kv": {"kv-4": acc(0.25, 64)}}]
    assert "k = 0 students (no attention head): k=0 kv-4 25.0%" in _students_status(None, ctl)[1]


def test_diminishing_returns_needs_the_paired_halves_to_differ():
    from gna_lens.findings.render import render_markdown

    def cell(k, vs_high):
        row = {"task": "kv-question", "n": 60, "chance": 1 / 6, "before": acc(0.77),
               "after": acc(0.15), "change": iv(-0.62, -0.74, -0.5),
               "random_change": iv(-0.02, -0.06, 0.02), "vs_random": iv(-0.6, -0.72, vs_high),
               "p_value": 1e-4}  # fmt: skip
        return {"selected_on": "question", "k": k, "heads_label": [], "rows": [row],
                "control": {"n": 64, "change": iv(0.05, 0.02, 0.08)}}  # fmt: skip

    def r10(diff, vs_high=-0.48):
        halves = {"h": 8, "first": iv(0.6, 0.5, 0.7), "second": iv(0.05, 0.0, 0.1),
                  "first_minus_second": iv(*diff)}  # fmt: skip
        return {"order": [f"L{i}H0" for i in range(16)], "n_eval": 60, "n_prose": 64,
                "random_draws": 10, "cells": [cell(8, vs_high), cell(16, vs_high)],
                "halves": {"kv-question": halves},
                "masks_facts": {"gather_heads": ["L1H0"], "aggregate_heads": ["L2H0"],
                                "baseline": acc(0.5), "kept": acc(0.48), "denied": acc(0.5),
                                "chance": 1 / 6}}  # fmt: skip

    def status(r):
        return {x["claim"][:17]: x["status"] for x in status_rows({"10": r})}

    assert status(r10((0.55, 0.4, 0.7)))["A handful of head"] == "reproduced"
    # the point estimate says "fewer", the interval does not: inconclusive, not reproduced
    assert status(r10((0.2, -0.05, 0.45)))["A handful of head"] == "inconclusive"
    assert status(r10((-0.3, -0.5, -0.1)))["A handful of head"] == "not reproduced"
    # the top 8 must beat random sets first
    assert status(r10((0.55, 0.4, 0.7), vs_high=0.02))["A handful of head"] == "not reproduced"
    # finding 1's masks on the facts template: denying changes nothing -> not credited
    assert status(r10((0.55, 0.4, 0.7)))["Keeping only the "] == "not reproduced"
    claims = {c["claim"][:20]: c["status"] for c in seed_claims({"10": r10((0.55, 0.4, 0.7))})}
    assert claims["A handful of heads c"] == "reproduced"
    page = render_markdown({"10": r10((0.55, 0.4, 0.7)), "seconds": {}}, "make findings")
    assert "## 10. How many heads" in page and page.count("| question top ") == 2
    assert "| diminishing returns |" in page


def test_students_at_chance_on_the_facts_template_recover_only_copying():
    """A top-k student that retrieves on the question template (copying answers it) but sits at
    chance on the facts template, where the teacher does not, has not recovered the teacher's
    retrieval: the claim cannot be reproduced, and the row says why."""
    from gna_lens.findings.status import _students_status

    def row(kind, heads, seed, correct, kv):
        return {"name": f"{kind}{heads}{seed}", "kind": kind, "k": 1, "heads": [[0, heads]],
                "seed": seed, "data": "default", "kv_correct": {"kv-4": correct}, "kv": kv}  # fmt: skip

    good, bad = [1] * 40, [0] * 40
    top_kv = {"kv-4": acc(1.0, 40), "kv-4-facts": acc(0.22, 64)}
    rows = [row("top", 9, s, good, top_kv) for s in (0, 1)]
    rows += [row("random", h, s, bad, {"kv-4": acc(0.0, 40)}) for h in range(1, 21) for s in (0, 1)]
    rows.append({"name": "teacher", "kind": "teacher", "kv": {"kv-4": acc(0.83, 64),
                 "kv-4-facts": acc(0.55, 64)}})  # fmt: skip
    ctl = {"rows": rows, "comparisons": [], "method": {}, "kv_tasks": ["kv-4", "kv-4-facts"],
           "chance": {"kv-4": 0.25, "kv-4-facts": 0.25}}  # fmt: skip
    status, why = _students_status(None, ctl)
    assert status == "partly" and "what copying does" in why, why
    assert "teacher kv-4-facts 55.0% [" in why
    # the same students above chance on the facts template: nothing holds the claim back
    for r in rows[:2]:
        r["kv"] = {"kv-4": acc(1.0, 40), "kv-4-facts": acc(0.6, 64)}
    assert _students_status(None, ctl)[0] == "reproduced"
