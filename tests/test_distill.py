"""Hybrid students, part 2 (gna_lens.hybrid): distill, swap_heads, run_experiment / gna-lens hybrid.

Checked here: both distillation stages lower their loss; a stage whose loss runs away (a planted
learning rate) stops with DistillationDiverged naming the stage, the step and the losses, and a
healthy run does not; a run interrupted and resumed from its checkpoint ends on the
uninterrupted run's weights bit for bit; stage 2's blocked KL equals the plain formula, value
and gradient; budgets parse or are refused with
the input repeated; the distillation data never shares a seed, a prompt, a prose window or an
MMLU question with the evaluation sets; swap_heads trains only the new parameters, the swapped
head is an editable attention head of the head view, the swapped model steps, saves and loads;
the experiment command runs end to end on a tiny teacher and writes its table.
"""

import functools
import itertools
import json
import math

import pytest
import torch
from interventions_helpers import KEYS, hook_count, tok, tokens
from interventions_helpers import model as helper_model
from interventions_helpers import task as make_task

import gna_lens.interventions as I
from gna_lens.errors import ConfigError, DistillationDiverged, GnaLensError, PatternEditError
from gna_lens.heads import head_view
from gna_lens.hybrid import (
    DISTILL_SEEDS,
    EVALUATION_SEEDS,
    Budget,
    build_hybrid,
    default_distill_data,
    distill,
    parse_budget,
    state_bytes,
    swap_heads,
)
from gna_lens.models import HookedSSM, load_model
from gna_lens.runtime import override_speed_probe

KEEP = [(0, 1), (1, 2)]
PATTERN = "blocks.{}.mixer.hook_pattern"


@functools.cache
def texts() -> tuple[str, ...]:
    """KV texts of the tiny word tokenizer (every word one token), with their answers."""
    out = []
    for seed in range(24):
        for s in make_task(n_pairs=4, n_samples=8, seed=100 + seed):
            out.append(s.prompt + s.choices[s.answer_index])
    return tuple(out)


def _student(keep=KEEP, seed=0) -> HookedSSM:
    return build_hybrid(helper_model("llama"), keep, d_state=8, seed=seed)


def _run(**kw):
    student = _student()
    kw = {"budget": 900, "batch_size": 4, "progress": False, "checkpoint_every": 2} | kw
    return student, distill(student, helper_model("llama"), list(texts()), **kw)


# ----------------------------------------------------------------------------- distill
def test_both_stages_lower_their_loss_and_train_only_the_ssm_heads():
    student = _student()
    before = {k: v.clone() for k, v in student.state_dict().items()}
    res = distill(
        student, helper_model("llama"), list(texts()), budget=1600, batch_size=4, warmup=1,
        lr=(1e-2, 3e-3), progress=False,
    )  # fmt: skip
    for stage in ("stage1", "stage2"):
        start, end = res.loss_change(stage)
        assert end < 0.9 * start, (stage, start, end)
    after = student.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    ssm = ("c_proj", "b_proj", "x_proj", "dt_proj", "dt_bias", "A_log", ".D")
    assert changed and all(".mixer." in k and any(p in k for p in ssm) for k in changed)
    df = res.to_dataframe()
    assert set(df["stage"]) == {"stage1", "stage2"}
    assert sorted(set(df[df["stage"] == "stage1"]["layer"])) == [0, 1]  # each layer alone
    assert res.totals["stage1"]["tokens"] >= 400 and res.totals["stage2"]["tokens"] >= 1200
    assert res.complete and res.n_trained["stage1"] == res.n_trained["stage2"]


@pytest.mark.parametrize(
    ("stages", "lr", "says"),
    [
        ((1, 2), (0.3, 1e-3), r"stage1 diverged at step 2: its loss rose to [0-9.e+]+ \(mean of "
         r"steps 1-2\), more than divergence_factor=10 times its starting loss 2\.45"),
        ((2,), 100.0, r"stage2 diverged at step 2: its loss is nan \(step 2\), not finite; it "
         r"started at 0\.65"),
    ],
    ids=["stage1-rises", "stage2-not-finite"],
)  # fmt: skip
def test_a_diverging_stage_stops_with_an_error_naming_the_step_and_the_loss(stages, lr, says):
    """A planted learning rate blows the loss up within two steps: the run stops there with
    DistillationDiverged (a GnaLensError), naming the stage, the step, both losses and the fix;
    with divergence_factor=None the same run finishes on its broken weights, as it used to."""
    with pytest.raises(DistillationDiverged, match=says) as err:
        _run(stages=stages, lr=lr, warmup=1)
    assert isinstance(err.value, GnaLensError)
    assert "Fix: a lower learning rate" in str(err.value) and "lr=" in str(err.value)
    _, silent = _run(stages=stages, lr=lr, warmup=1, divergence_factor=None)
    before, after = silent.loss_change(f"stage{stages[0]}")
    assert silent.complete and not after < 10 * before  # nan or far above: what went unseen


def test_a_healthy_run_does_not_trip_the_divergence_check():
    _, res = _run(divergence_factor=1.5)  # tighter than the default 10
    assert res.complete and res.method["divergence_factor"] == 1.5
    assert all(math.isfinite(r["loss"]) and isinstance(r["loss"], float) for r in res.records)
    with pytest.raises(ConfigError, match=r"divergence_factor=0\.5\); expected a number above 1"):
        _run(divergence_factor=0.5)


def test_blocked_kl_equals_the_plain_formula_with_its_gradient(monkeypatch):
    from gna_lens.hybrid import _distill

    monkeypatch.setattr(_distill, "KL_BLOCK", 3 * 50)  # blocks of 3 tokens
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(2, 7, 50, generator=gen, dtype=torch.float64).requires_grad_()
    t = torch.randn(2, 7, 50, generator=gen, dtype=torch.float64)
    mask = torch.rand(2, 7, generator=gen) > 0.3
    for temperature in (1.0, 2.0):
        ls = torch.log_softmax(s.float() / temperature, -1)
        lt = torch.log_softmax(t.float() / temperature, -1)
        kl = (lt.exp() * (lt - ls)).sum(-1)
        plain = (kl * mask).sum() / mask.sum()
        blocked = _distill._kl(s, t, mask, temperature)
        assert blocked.item() == plain.item()
        (g_plain,) = torch.autograd.grad(plain, s)
        (g_blocked,) = torch.autograd.grad(blocked, s)
        assert (g_plain - g_blocked).abs().max().item() < 1e-8


def _key(res):
    return [
        (r["stage"], r["step"], r["layer"], r["loss"], r["tokens"], r["lr"]) for r in res.records
    ]


@pytest.mark.parametrize("stops", [(3,), (1, 4)], ids=["stage1", "stage1-then-stage2"])
def test_resume_gives_the_uninterrupted_run_bit_for_bit(tmp_path, stops):
    ref, ref_res = _run()
    for n in stops:  # interrupted calls (max_steps), each resuming the previous
        _, part = _run(checkpoint_dir=tmp_path, max_steps=n)
        assert not part.complete
    student, res = _run(checkpoint_dir=tmp_path)
    assert res.complete and res.resumed_at is not None
    a, b = ref.state_dict(), student.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _key(res) == _key(ref_res) and res.probe == ref_res.probe
    # a finished run is read back, not rerun
    again, res2 = _run(checkpoint_dir=tmp_path)
    assert res2.resumed_at["stage"] == 2 and all(
        torch.equal(a[k], again.state_dict()[k]) for k in a
    )


@pytest.mark.parametrize("slower", [True, False], ids=["bf16-measured-slower", "bf16-faster"])
def test_autocast_auto_decides_by_a_timed_step_and_leaves_no_trace(slower):
    """autocast="auto" times one training step both ways (here the clock is overridden, so both
    branches run on every CPU): bfloat16 measured slower gives exactly the float32 run; faster
    gives exactly the bfloat16 run; the result says what was measured."""
    probe = (0.01, 0.105) if slower else (0.02, 0.01)
    with override_speed_probe(probe):
        student, res = _run(autocast="auto")
    same, same_res = _run(autocast=None if slower else "bfloat16")
    a, b = student.state_dict(), same.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the probe trained nothing, drew no randoms
    assert _key(res) == _key(same_res) and res.probe == same_res.probe
    choice = res.method["autocast_choice"]
    assert res.method["autocast"] == (None if slower else "bfloat16")
    assert res.method["autocast_probe"]["what"] == "one training step on 4 x 256 tokens"
    if slower:
        assert choice.startswith("auto: float32, because bfloat16 autocast 10.50x slower"), choice
    else:
        assert choice.startswith("auto: bfloat16 autocast, because bfloat16 autocast 2.00x"), choice
        assert "; checked: stage-2 KL on the probe batch" in choice
    with pytest.raises(ConfigError, match=r"autocast='fp8'\); expected None, 'bfloat16'"):
        _run(autocast="fp8")


def test_a_checkpoint_of_other_settings_is_refused(tmp_path):
    _run(checkpoint_dir=tmp_path, max_steps=1)
    with pytest.raises(ConfigError, match=r"other settings \(lr: saved"):
        _run(checkpoint_dir=tmp_path, lr=0.05)
    _run(checkpoint_dir=tmp_path, lr=0.05, resume=False, max_steps=1)  # starts over


def test_distill_refuses_what_it_cannot_do():
    teacher = helper_model("llama")
    with pytest.raises(ConfigError, match=r"hybrid student of gna_lens\.hybrid\.build_hybrid"):
        distill(helper_model("mamba2"), teacher, list(texts()))
    with pytest.raises(ConfigError, match="stages="):
        distill(_student(), teacher, list(texts()), stages=(3,))
    with pytest.raises(ConfigError, match="budget='2M'"):
        distill(_student(), teacher, list(texts()), budget="2M")
    with pytest.raises(ConfigError, match="no SSM heads"):
        distill(_student(keep=[(a, b) for a in range(2) for b in range(4)]), teacher, texts())
    with pytest.raises(ConfigError, match=r"item 1 is a int"):
        distill(_student(), teacher, ["a b c", 3], progress=False, batch_size=1)
    with pytest.raises(ConfigError, match="ran out"):
        distill(_student(), teacher, list(texts())[:8], budget=10_000, progress=False)
    from gna_lens.testing import tiny_hf_model

    other = tiny_hf_model("llama", num_hidden_layers=3)
    with pytest.raises(ConfigError, match="does not match"):
        distill(_student(), other, list(texts()))


@pytest.mark.parametrize(
    "value, tokens, seconds",
    [
        (5000, 5000, None),
        ("2M tokens", 2_000_000, None),
        ("500k tok", 500_000, None),
        ("1,500 tokens", 1500, None),
        ("20 min", None, 1200.0),
        ("20min", None, 1200.0),
        ("1.5 h", None, 5400.0),
        ("90 s", None, 90.0),
    ],
)
def test_budgets_parse(value, tokens, seconds):
    assert parse_budget(value) == Budget(tokens=tokens, seconds=seconds)


@pytest.mark.parametrize(
    "value, message",
    [
        ("2M", "ambiguous: million tokens or minutes"),
        ("200", "has no unit"),
        ("5 parsecs", "unknown unit 'parsecs'"),
        ("2k min", "a multiplier"),
        ("fast", "not a number with a unit"),
        (0, "positive number of tokens"),
        (-5, "positive number of tokens"),
        (True, r"\(bool\)"),
        (2.5, r"\(float\)"),
        (None, r"\(NoneType\)"),
        ("0 tokens", "at least one token"),
    ],
)
def test_bad_budgets_are_refused_repeating_the_input(value, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_budget(value)
    assert repr(value) in str(err.value)


# ----------------------------------------------------------------------------- data
def test_distillation_seeds_lie_above_every_evaluation_seed():
    from gna_lens.hybrid._data import EVAL_KV_SEED, SELECTION_SEED, distill_kv_seed
    from gna_lens.lm_eval.tasks import _KV_SEED, KV_SELECTION_SEED
    from gna_lens.zoo.curriculum import EVAL_SEED, KV_MAX_PAIRS

    used = {SELECTION_SEED, EVAL_KV_SEED + 100, KV_SELECTION_SEED, _KV_SEED + 1}
    used |= {EVAL_SEED + n for n in range(KV_MAX_PAIRS + 1)} | {0, 1, 2}
    covered = set().union(*(set(r) for r in EVALUATION_SEEDS.values()))
    assert used <= covered
    assert max(covered) < DISTILL_SEEDS.start
    assert distill_kv_seed(0, 0) == DISTILL_SEEDS.start
    assert distill_kv_seed(999, 999) == DISTILL_SEEDS.stop - 1
    with pytest.raises(ConfigError, match=r"0\.\.999"):
        distill_kv_seed(1000, 0)


def test_distillation_prompts_are_disjoint_from_the_evaluation_prompts():
    """The prompts themselves, not only the seeds: selection, held-out KV, and the prose half."""
    from gna_lens.hybrid._data import EVAL_KV_SEED, SELECTION_SEED, _prose_texts
    from gna_lens.tasks import kv_retrieval, load_prose, text_control
    from gna_lens.testing import tiny_tokenizer

    t = tok()
    data = default_distill_data(t, kv_pairs=(2, 4), kv_words=KEYS)
    assert data.sources == ("kv-paper",) and "prose" in data.info["left_out"]
    drawn = list(itertools.islice(data, 2000))
    evals = [
        kv_retrieval(t, n_pairs=n, n_samples=64, seed=EVAL_KV_SEED + n, words=KEYS)
        for n in (2, 3, 4)
    ]
    evals.append(kv_retrieval(t, n_pairs=4, n_samples=64, seed=SELECTION_SEED, words=KEYS))
    prompts = {s.prompt for task in evals for s in task}
    assert not any(text.startswith(p) for text in drawn for p in prompts if len(p) > 60)
    # the same texts on every iteration (a resumed run skips exactly what it had read)
    assert drawn[:50] == list(itertools.islice(data, 50))
    # prose: distillation texts come from before the held-out (eval) windows
    tt = tiny_tokenizer()
    prose = load_prose()
    pieces = _prose_texts(tt, 256)
    end = max(prose.index(p) + len(p) for p in pieces)
    held = text_control(tt, split="eval", n_sequences=4, seq_len=32, max_unknown=1.0)
    offsets = tt(prose, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert end <= offsets[min(held.info["starts"])][0]
    assert sum(len(p) for p in pieces) > 0.4 * len(prose)  # and they use that first half


def test_mmlu_distillation_texts_never_hold_a_held_out_question_or_an_answer():
    from gna_lens.hybrid._data import _mmlu_texts, mmlu_split
    from gna_lens.tasks import load_mmlu

    records = load_mmlu()
    rest, held = mmlu_split(records)
    assert len(rest) + len(held) == len(records) and {r.id for r in rest}.isdisjoint(
        r.id for r in held
    )
    texts_ = _mmlu_texts()
    assert len(texts_) == len(rest)
    held_questions = {r.question for r in held} - {r.question for r in rest}
    assert not any(t.split("\n")[0] in held_questions for t in texts_[:2000])
    assert not any(
        "Answer" in t.splitlines()[-1] and t.rstrip()[-1] in "ABCD" for t in texts_[:200]
    )


# ----------------------------------------------------------------------------- swap_heads
@functools.cache
def _swapped():
    model = helper_model("mamba2")
    return model, swap_heads(
        model, [(1, 0)], train_data=list(texts()), budget=600, batch_size=4, progress=False
    )


def test_swap_heads_trains_only_the_new_parameters():
    model, swapped = _swapped()
    old, new = model.state_dict(), swapped.state_dict()
    assert all(torch.equal(old[k], new[k]) for k in old)  # every old parameter bit-identical
    added = sorted(set(new) - set(old))
    assert added == [
        "blocks.1.mixer.attn_conv.bias", "blocks.1.mixer.attn_conv.weight",
        "blocks.1.mixer.attn_proj.weight",
    ]  # fmt: skip
    init = swap_heads(
        model, [(1, 0)], train_data=list(texts()), budget=1, batch_size=4, progress=False
    )
    moved = [k for k in added if not torch.equal(init.state_dict()[k], new[k])]
    assert moved == added  # and the new ones trained
    before, after = swapped.gna_swap_result.loss_change("swap")
    assert after < before
    assert swapped.gna_swap["heads"] == [[1, 0]] and head_view(model).kind(1) == "ssm"


def test_a_swapped_head_starts_from_its_own_rows_and_reads_them_as_attention():
    model = helper_model("mamba2")
    s = swap_heads(
        model, [(0, 3)], train_data=list(texts()), budget=1, batch_size=4, progress=False
    )
    mixer = s.blocks[0].mixer
    ids = tokens(make_task())[:2]
    names = [
        f"blocks.0.mixer.{n}"
        for n in ("hook_ssm_input", "hook_ssm_B", "hook_ssm_C", "hook_q", "hook_k", "hook_v")
    ]
    with torch.no_grad():
        _, cache = s.run_with_cache(ids, names_filter=names)
    x, B, C, q, k, v = (cache[n] for n in names)
    g = 3 // (mixer.cfg.n_heads // mixer.cfg.n_groups)
    # one step of training at lr warm-up moves them by ~1e-4: equal up to that
    assert torch.allclose(q[:, :, 0], C[:, :, g], atol=1e-2)
    assert torch.allclose(k[:, :, 0], B[:, :, g], atol=1e-2)
    assert torch.allclose(v[:, :, 0], x[:, :, 3], atol=1e-2)


def test_the_swapped_head_is_an_editable_attention_head_of_the_head_view():
    _, s = _swapped()
    view = head_view(s)
    assert view.kind(1) == "mixed" and view.kind_of((1, 0)) == "attention"
    assert view.kind_of((1, 1)) == "ssm" and view.kind(0) == "ssm"
    ids = tokens(make_task())[:2]
    name = PATTERN.format(1)
    with torch.no_grad():
        clean = s(ids)
        _, cache = s.run_with_cache(ids, names_filter=name)
        mat = s.run_with_hooks(ids, fwd_hooks=[(name, lambda t, hook: t)])
    pattern = cache[name]
    assert torch.allclose(pattern[:, 0].sum(-1), torch.ones(1))  # a softmax row
    assert pattern[:, 0].triu(1).abs().max() == 0
    assert (mat - clean).abs().max() < 1e-5  # materialized == fast path

    def only_self(t, hook):
        t = t.clone()
        t[:, 0] = torch.eye(t.shape[-1])
        return t

    with torch.no_grad():
        edited = s.run_with_hooks(ids, fwd_hooks=[(name, only_self)])
    assert (edited - clean).abs().max() > 1e-3
    with (
        torch.no_grad(),
        I.mask_patterns(
            s, {(1, 0): torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()}
        ),
    ):
        same = s(ids)
    assert (same - clean).abs().max() < 1e-5
    with pytest.raises(PatternEditError), torch.no_grad():
        s.run_with_hooks(ids, fwd_hooks=[(name, lambda t, hook: t[:, :1])])


def test_a_swapped_model_steps_ablates_scores_and_saves(tmp_path):
    _, s = _swapped()
    t = make_task()
    ids = tokens(t)[:3]
    before = hook_count(s)
    with torch.no_grad():
        full = s(ids)[:, -1]
        logits, prefix = s.prefix_state(ids)
        assert (s.step(prefix) - full).abs().max() < 1e-5 and (logits - full).abs().max() < 1e-5
    res = I.ablation_sweep(s, t, "logit_diff", positions="last", pack=4, progress=False)
    loop = []
    from gna_lens.interventions.metrics import Metric

    met, idx = Metric("logit_diff", t), torch.arange(len(t))
    with torch.no_grad():
        for head in [(1, 0), (1, 1)]:
            with I.ablate_heads(s, [head], positions="last"):
                loop.append(met(s(tokens(t))[:, -1], idx))
    got = res.values[[res.cells.index(((1, 0),)), res.cells.index(((1, 1),))]]
    assert (got - torch.stack(loop)).abs().max() <= 1e-5
    assert res.kinds[res.cells.index(((1, 0),))] == "attention"
    from gna_lens import score_heads

    report = score_heads(s, t, control=None, progress=False, n_examples=1)
    assert report.to_dataframe().set_index(["layer", "head"]).loc[(1, 0), "kind"] == "attention"
    assert hook_count(s) == before
    folder = s.save_pretrained(tmp_path / "swapped")
    again = load_model(str(folder))
    assert isinstance(again, HookedSSM) and again.gna_provenance.format == "gna_lens"
    a, b = s.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(again(ids), s(ids))
    assert head_view(again).kind_of((1, 0)) == "attention" and again.gna_swap["heads"] == [[1, 0]]
    sb = state_bytes(again)
    assert (sb.attention_heads, sb.kv_heads) == (1, 1)
    assert sb.kv_bytes_per_token == (s.cfg.d_state + s.cfg.d_head) * 4


def test_swap_heads_refuses_what_it_cannot_swap():
    model = helper_model("mamba2")
    with pytest.raises(ConfigError, match=r"\(2, 0\), not an SSM head"):
        swap_heads(model, [(2, 0)], train_data=list(texts()))
    with pytest.raises(ConfigError, match="one \\(layer, head\\) pair"):
        swap_heads(model, (1, 0), train_data=list(texts()))
    with pytest.raises(ConfigError, match="Mamba-2 layers only"):
        swap_heads(helper_model("mamba1"), [(0, 0)], train_data=list(texts()))
    with pytest.raises(ConfigError, match="already has swapped heads"):
        swap_heads(_swapped()[1], [(1, 2)], train_data=list(texts()))
    with pytest.raises(ConfigError, match="build it again keeping the head"):
        swap_heads(_student(), [(0, 0)], train_data=list(texts()))


# ----------------------------------------------------------------------------- experiment
def test_the_hybrid_command_runs_end_to_end_and_writes_the_table(tmp_path, capsys):
    from gna_lens.cli import main
    from gna_lens.tasks import load_words
    from gna_lens.tasks.toy_tokenizers import word_tokenizer
    from gna_lens.testing import tiny_checkpoint

    t = word_tokenizer(
        [
            "Below is a list of key-value pairs. What is the value for key ? :",
            "Memorize the following dictionary: The value of the key ' is",
            " ".join(load_words()[:60]),
        ],
        bos=True,
    )
    teacher = tiny_checkpoint("llama", tmp_path / "teacher", vocab_size=len(t))
    t.save_pretrained(teacher)
    out = tmp_path / "out"
    args = ["hybrid", str(teacher), "--keep", "0,2", "--budget", "300", "--out", str(out)]
    args += ["--n-eval", "12", "--n-rank", "6", "--kv-pairs", "2,4", "--n-knowledge", "0"]
    args += ["--batch-size", "4", "--quiet"]
    assert main(args) == 0
    assert {"table.md", "table.csv", "table.json", "table.svg", "ranking.json"} <= {
        p.name for p in out.iterdir()
    }
    data = json.loads((out / "table.json").read_text())
    names = [r["name"] for r in data["rows"]]
    assert names == ["teacher", "k=0", "top-2", "random-2"]
    top2 = data["rows"][2]
    assert [tuple(h) for h in top2["heads"]] == sorted(tuple(h) for h in data["ranking"][:2])
    # each size in the question template and the induction-proof facts template
    tasks = {"kv-2", "kv-4", "kv-2-facts", "kv-4-facts"}
    assert set(top2["kv"]) == tasks and top2["kv"]["kv-2"]["method"] == "wilson"
    assert "facts template" in data["method"]["held_out"]
    assert (
        top2["state"]["4096"]["kv_cache_bytes"]
        > 0
        == data["rows"][1]["state"]["4096"]["kv_cache_bytes"]
    )
    assert top2["distill"]["totals"]["stage2"]["tokens"] >= 225
    method = data["method"]
    for key in ("budget", "data", "stages", "seeds", "student", "teacher", "machine"):
        assert key in method, key
    assert "local folder" in method["teacher"] and "prose" in method["notes"]
    comp = {c["task"]: c for c in data["comparisons"]}
    assert set(comp) == tasks and comp["kv-2"]["k"] == 2
    paired = comp["kv-2"]["paired_random"]  # over the same held-out prompts
    top_c, rand_c = (torch.tensor(data["rows"][i]["kv_correct"]["kv-2"]) for i in (2, 3))
    assert paired["value"] == pytest.approx(float((top_c - rand_c).double().mean()))
    md = (out / "table.md").read_text()
    assert md.count("\n| ") >= 4 and "bytes/token L=4096 (state + KV)" in md
    s = top2["state"]["4096"]
    kv_part = f"{s['recurrent_bytes'] / 4096:,.0f} + {s['kv_cache_bytes'] / 4096:,.0f})"
    assert kv_part in md
    assert (out / "table.svg").read_text().startswith("<svg")
    # a rerun reads the finished rows back (no distillation)
    assert main([*args[:-1], "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["rows"][2]["kv"] == top2["kv"]
    # another budget re-distills the students but reads back the ranking and the teacher's row,
    # which do not depend on it
    import gna_lens.hybrid._experiment as experiment

    def refuse(*a, **k):
        raise AssertionError("ranked or measured the teacher again")

    real_measure = experiment._measure
    calls = []

    def measure(model, *a, **k):
        calls.append(type(model).__name__)
        return real_measure(model, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(experiment, "_rank", refuse)
        mp.setattr(experiment, "_measure", measure)
        assert main([*[a if a != "300" else "240" for a in args[:-1]], "--json"]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["rows"][0] == data["rows"][0] and other["ranking"] == data["ranking"]
    assert calls == ["HookedSSM"] * 3  # the three students, not the teacher
    assert other["method"]["budget"].startswith("240 tokens"), other["method"]["budget"]
    bad = main(
        ["hybrid", str(teacher), "--keep", "0,99", "--budget", "300", "--out", str(out), "--quiet"]
    )
    assert bad == 2 and "99 is not a number of heads" in capsys.readouterr().err


def test_a_distilled_student_runs_through_score_heads_and_ablate_heads():
    student, _ = _run(budget=300)
    t = make_task()
    from gna_lens import score_heads

    report = score_heads(student, t, control=None, progress=False, n_examples=1)
    assert report.to_dataframe().set_index(["layer", "head"]).loc[(1, 2), "kind"] == "attention"
    ids = tokens(t)
    with torch.no_grad():
        clean = student(ids)
        with I.ablate_heads(student, [(1, 2), (0, 0)]):
            ablated = student(ids)
    assert (ablated - clean).abs().max() > 1e-4


@pytest.mark.parametrize("arch", ["bamba", "nemotron_h"])
def test_swap_heads_works_in_a_mamba2_hybrid(arch, tmp_path):
    model = helper_model(arch)
    layer = model.cfg.layer_types.index("ssm")
    s = swap_heads(
        model, [(layer, 1)], train_data=list(texts()), budget=100, batch_size=4, progress=False
    )
    assert head_view(s).kind_of((layer, 1)) == "attention"
    ids = tokens(make_task())[:2]
    name = PATTERN.format(layer)
    with torch.no_grad():
        clean = s(ids)
        mat = s.run_with_hooks(ids, fwd_hooks=[(name, lambda t, hook: t)])
        logits, _ = s.prefix_state(ids)
    assert (mat - clean).abs().max() < 1e-4 and (logits - clean[:, -1]).abs().max() < 1e-4
    again = load_model(str(s.save_pretrained(tmp_path / arch)))
    with torch.no_grad():
        assert torch.equal(again(ids), clean)
