"""The zoo: every shipped model loads offline, and its card's accuracies are what it measures."""

import json

import pytest
import torch

import gna_lens
from gna_lens import zoo
from gna_lens.errors import ConfigError
from gna_lens.tasks import evaluate
from gna_lens.zoo.curriculum import EVAL_TASKS, load_world

NAMES = ["zoo-llama", "zoo-mamba2", "zoo-mamba1", "zoo-bamba"]
BRIDGE = {"zoo-llama"}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", params=NAMES)
def loaded(request):
    return request.param, zoo.load(request.param)


def test_every_architecture_is_shipped():
    assert zoo.names() == sorted(NAMES)


def test_load_offline_gives_the_right_wrapper(loaded, monkeypatch):
    name, model = loaded
    kind = "TransformerBridge" if name in BRIDGE else "HookedSSM"
    assert type(model).__name__ == kind
    assert model.tokenizer is not None and model.cfg.n_layers == zoo.card(name).raw["config"].get(
        "num_hidden_layers", model.cfg.n_layers
    )
    # load_model resolves zoo names too, without a hub.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert type(gna_lens.load_model(name)).__name__ == kind


def test_card_accuracies_are_remeasured(loaded):
    """Each card was measured on exactly these splits; re-measuring gives the same numbers."""
    name, model = loaded
    card = zoo.card(name)
    tasks = zoo.tasks(model.tokenizer)
    assert list(card.accuracy) == list(EVAL_TASKS)
    for task_name in EVAL_TASKS:
        res = evaluate(model, tasks[task_name], batch_size=50, progress=False)
        assert len(res) == card.n_samples[task_name]
        assert res.chance == pytest.approx(card.chance[task_name])
        assert abs(res.accuracy - card.accuracy[task_name]) <= 0.02, (name, task_name)


def test_the_plain_hf_folder_loads_with_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = zoo.path("zoo-llama")
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert model.config.vocab_size == len(tok)
    assert {"model.safetensors", "card.json", "README.md", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()
    }


def test_cards_describe_what_the_project_relies_on():
    """Every model knows the world's facts; the SSMs retrieve, worse as dictionaries grow."""
    for name in NAMES:
        assert zoo.card(name).accuracy["cloze"] >= 0.9, name
    mamba2 = zoo.card("zoo-mamba2").accuracy
    assert mamba2["kv-8"] >= 0.8
    for name in ("zoo-mamba2", "zoo-mamba1"):
        acc = zoo.card(name).accuracy
        assert acc["kv-2"] > acc["kv-16"], name


def test_letter_unseen_split_is_held_out_from_letter_training():
    world = load_world()
    held = {(f.entity, f.relation) for f in world.select("held-out")}
    unseen = zoo.tasks()["letter-unseen"]
    asked = {tuple(s.info["id"].split("/")[:2]) for s in unseen}
    assert asked == held and len(held) == 60


def test_letter_and_cloze_ask_the_same_prompts_of_every_fact():
    t = zoo.tasks()
    letter, cloze = t["letter"], t["cloze"]
    assert len(letter) == len(cloze) == len(load_world().facts)
    assert [s.prompt for s in letter] == [s.prompt for s in cloze]
    assert letter[0].choices == [" A", " B", " C", " D"] and cloze[0].choices != letter[0].choices


def test_world_json_is_what_make_world_generates():
    """world.json is frozen; regenerating it from its seed must give the same world."""
    from gna_lens.zoo.curriculum import make_world

    world = load_world()
    assert json.loads(make_world(world.seed).to_json()) == json.loads(world.to_json())


def test_unknown_zoo_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"zoo-gpt.*zoo-llama"):
        zoo.path("zoo-gpt")
    with pytest.raises(ConfigError, match=r"zoo-gpt.*zoo-llama"):
        gna_lens.load_model("zoo-gpt")


def test_kv_fraction_interleaves_kv_and_fact_batches():
    from gna_lens.zoo.curriculum import build_tokenizer, training_batches

    world = load_world()
    tok = build_tokenizer(world)
    query = tok(" key", add_special_tokens=False)["input_ids"][0]  # only KV documents say "key"

    def kinds(fraction: float, n: int = 8) -> list[bool]:
        batches = training_batches(world, tok, 2, seed=0, kv_fraction=fraction)
        return [bool((next(batches)[0] == query).any()) for _ in range(n)]

    assert kinds(0.5) == [True, False] * 4  # the shipped recipes' alternation, KV first
    assert sum(kinds(0.75)) == 6
    assert all(kinds(1.0))
    with pytest.raises(gna_lens.errors.TaskError, match="kv_fraction=0"):
        next(training_batches(world, tok, 2, seed=0, kv_fraction=0))


def test_init_like_mamba2_gives_a_hybrid_long_memory_and_live_convolutions():
    from dataclasses import replace

    from gna_lens.zoo.curriculum import build_tokenizer
    from gna_lens.zoo.train import RECIPES, build_model, init_like_mamba2

    tok = build_tokenizer(load_world())
    recipe = replace(RECIPES["zoo-bamba"], zero_init_residual=False, embedding_std=None)
    hf = build_model(replace(recipe, mamba2_init=False), tok)
    ours = build_model(replace(recipe, mamba2_init=True), tok)
    assert init_like_mamba2(build_model(recipe, tok)) == 4  # one per Mamba-2 layer
    dt = torch.nn.functional.softplus(
        torch.cat([m.dt_bias for m in ours.modules() if hasattr(m, "dt_bias")])
    )
    assert dt.min() >= 0.99e-3 and dt.max() <= 0.101  # log-uniform in [dt_min, dt_max]
    hf_dt = torch.nn.functional.softplus(
        next(m.dt_bias for m in hf.modules() if hasattr(m, "dt_bias"))
    )
    assert torch.allclose(hf_dt, torch.full_like(hf_dt, 1.3133), atol=1e-3)  # transformers' init
    conv = lambda m: next(x.conv1d.weight for x in m.modules() if hasattr(x, "dt_bias")).std()  # noqa: E731
    assert conv(ours) > 5 * conv(hf)
    # attention and MLP weights are untouched: same seed, same values
    attn = lambda m: next(x.q_proj.weight for x in m.modules() if hasattr(x, "q_proj"))  # noqa: E731
    assert torch.equal(attn(ours), attn(hf))
    with pytest.raises(ConfigError, match="LlamaForCausalLM has no Mamba-2 mixer"):
        init_like_mamba2(build_model(RECIPES["zoo-llama"], tok))


def test_zero_init_residual_and_embedding_std_recipe_flags():
    from dataclasses import replace

    from gna_lens.zoo.curriculum import build_tokenizer
    from gna_lens.zoo.train import RECIPES, build_model, zero_residual_outputs

    tok = build_tokenizer(load_world())
    base = replace(RECIPES["zoo-bamba"], zero_init_residual=False, embedding_std=None)
    plain = build_model(base, tok)
    ours = build_model(replace(base, zero_init_residual=True, embedding_std=0.1), tok)
    names = [
        n for n, _ in ours.named_parameters() if n.endswith(("o_proj.weight", "down_proj.weight"))
    ]
    n_layers = ours.config.num_hidden_layers
    assert len(names) == n_layers + len(
        ours.config.attn_layer_indices
    )  # every MLP, every attention
    params = dict(ours.named_parameters())
    assert all(not params[n].any() for n in names)
    assert all(dict(plain.named_parameters())[n].std() > 0.01 for n in names)
    # the SSM mixers' out_proj and the attention inputs keep their init (same seed)
    mixer = lambda m: next(x.out_proj.weight for x in m.modules() if hasattr(x, "dt_bias"))  # noqa: E731
    assert torch.equal(mixer(ours), mixer(plain))
    emb = ours.get_input_embeddings().weight
    assert 0.09 < emb.std() < 0.11 and plain.get_input_embeddings().weight.std() < 0.03
    # a model built with the flags is still a working LM: zeroed blocks pass the stream through
    ids = tok("Memorize the following dictionary:\n", return_tensors="pt")["input_ids"]
    assert torch.isfinite(ours(ids).logits).all()
    with pytest.raises(ConfigError, match="MambaForCausalLM has no parameter named"):
        zero_residual_outputs(build_model(RECIPES["zoo-mamba1"], tok))


@pytest.mark.parametrize("name", NAMES)
def test_each_card_was_trained_with_its_shipped_recipe(name):
    """`gna-lens train-zoo NAME` reproduces the shipped checkpoint only if the recipe is the same."""
    from dataclasses import fields

    from gna_lens.zoo.train import RECIPES

    recipe, train = RECIPES[name], zoo.card(name).raw["training"]
    skip = {"name", "config_class", "config", "description", "aux_prev_tokens"}
    for f in fields(recipe):
        if f.name not in skip:
            assert train.get(f.name, f.default) == getattr(recipe, f.name), (name, f.name)
    assert tuple(train.get("aux_prev_tokens", ())) == recipe.aux_prev_tokens


def test_fan_in_init_redraws_linear_layers_but_not_the_tied_head():
    import math
    from dataclasses import replace

    from gna_lens.zoo.curriculum import build_tokenizer
    from gna_lens.zoo.train import RECIPES, build_model, fan_in_init

    tok = build_tokenizer(load_world())
    base = replace(RECIPES["zoo-llama"], fan_in_init=False, embedding_std=None)
    plain = build_model(base, tok)
    ours = build_model(replace(base, fan_in_init=True, embedding_std=0.3), tok)
    layer = lambda m: m.model.layers[0]  # noqa: E731
    for proj, fan_in in [("self_attn.q_proj", 128), ("mlp.down_proj", 384)]:
        w = layer(ours).get_submodule(proj).weight
        bound = 1 / math.sqrt(fan_in)
        assert w.abs().max() <= bound and 0.9 < w.std() * math.sqrt(3) / bound < 1.1
        assert layer(plain).get_submodule(proj).weight.std() < 0.021  # Llama's N(0, 0.02)
    emb = ours.get_input_embeddings().weight
    assert ours.lm_head.weight is emb and 0.29 < emb.std() < 0.31  # tied head not re-drawn
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in plain.modules()) - 1  # minus lm_head
    assert fan_in_init(build_model(base, tok)) == n_linear == 4 * 7
    ids = tok("Memorize the following dictionary:\n", return_tensors="pt")["input_ids"]
    assert not torch.allclose(ours(ids).logits, plain(ids).logits)
    with pytest.raises(ConfigError, match=r"Sequential has no torch\.nn\.Linear"):
        fan_in_init(torch.nn.Sequential(torch.nn.Embedding(3, 2)))


@pytest.mark.parametrize("name", ["zoo-llama", "zoo-mamba2"])  # a bridge and a HookedSSM
def test_load_model_hides_loading_bars_unless_asked(name, capfd):
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    gna_lens.load_model(name)
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # the user's setting is restored
    gna_lens.load_model(name, progress=True)
    assert "Loading weights" in capfd.readouterr().err
    hf_logging.disable_progress_bar()
    try:
        gna_lens.load_model(name)
        assert not hf_logging.is_progress_bar_enabled()  # not switched on behind the user's back
    finally:
        hf_logging.enable_progress_bar()


def test_tie_space_variants_counts_pairs_and_accepts_a_vocabulary_without_any():
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from gna_lens.zoo.train import tie_space_variants

    def tok(vocab: list[str]) -> PreTrainedTokenizerFast:
        ids = {w: i for i, w in enumerate([*vocab, "<unk>"])}
        return PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
        )

    cfg = LlamaConfig(
        vocab_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    assert tie_space_variants(model, tok(["a", "b", "c"])) == 0
    assert tie_space_variants(model, tok(["a", " a", "b"])) == 1
    emb = model.get_input_embeddings().weight
    assert torch.equal(emb[1], emb[0])


def _iv(value, low, high):
    return {"value": value, "low": low, "high": high}


def _acc(v, n=60):
    from gna_lens.stats import wilson_interval

    return wilson_interval(v * n, n).to_dict()


def test_findings_status_of_the_hybrid_follows_its_numbers():
    """Issue 30: "partly" only when denying the *attention* candidates lowers retrieval; an
    attention head merely among the candidates (zoo-bamba) is not reproduced."""
    from gna_lens.findings.status import _hybrid_status

    def result(kinds, kv8, attn=None, cloze=(1.0, 1.0)):
        def masked(pair):
            return None if pair is None else {"baseline": _acc(pair[0]), "denied": _acc(pair[1])}

        return {
            "model": "zoo-bamba",
            "aggregate_kinds": kinds,
            "aggregate_heads": [{"head": f"L{i}H0", "kind": k} for i, k in enumerate(kinds)],
            "masking": {
                "kv-8": {"baseline": _acc(kv8[0]), "denied": _acc(kv8[1]), "chance": 0.125},
                "cloze": {"baseline": _acc(cloze[0]), "denied": _acc(cloze[1]), "chance": 0.25},
            },
            "masking_by_kind": {"attention": masked(attn), "ssm": None},
        }

    ok = _hybrid_status(result(["attention"], (0.9, 0.3), attn=(0.9, 0.3)))
    assert ok["status"] == "reproduced"
    # zoo-bamba's case: an attention candidate, but denying it does not lower kv-8.
    bamba = _hybrid_status(result(["attention", "ssm", "ssm"], (0.88, 0.83), attn=(0.88, 0.86)))
    assert bamba["status"] == "not reproduced" and "does not show" in bamba["why"]
    # The drop comes from the SSM candidates alone: not credited to attention.
    ssm_drop = _hybrid_status(result(["ssm", "attention"], (0.9, 0.3), attn=(0.9, 0.88)))
    assert ssm_drop["status"] == "not reproduced"
    half = _hybrid_status(result(["ssm", "attention"], (0.9, 0.3), attn=(0.9, 0.4)))
    assert half["status"] == "partly" and "SSM head" in half["why"]
    assert _hybrid_status(result(["ssm", "ssm"], (0.9, 0.5)))["status"] == "not reproduced"
    assert _hybrid_status(result(["attention"], (0.15, 0.12)))["status"] == "not testable offline"
    assert "L0H0 (attention)" in bamba["numbers"] and "only the attention" in bamba["numbers"]


def test_findings_status_of_masks_and_removals_follows_their_numbers():
    from gna_lens.findings.status import _mask_status, _retrieval_status

    def masks(base, kept, denied, chance=0.25):
        return {"model": "zoo-x", "task": "letter", "chance": chance, "baseline": _acc(base),
                "kept": _acc(kept), "denied": _acc(denied)}  # fmt: skip

    assert _mask_status(masks(0.9, 0.9, 0.3))["status"] == "reproduced"
    # keeping works but denying does not hurt: keeping shows nothing (issue 39)
    assert _mask_status(masks(0.9, 0.92, 0.88))["status"] == "not reproduced"
    # Issue 30: all three conditions equal (zoo-llama's row under the union-mask bug).
    same = _mask_status(masks(0.907, 0.907, 0.907))
    assert same["status"] == "no result" and "changed no answer" in same["why"]
    assert _mask_status(masks(0.3, 0.3, 0.3))["status"] == "not testable offline"

    def removal(before, after, change, random_change, chance=1 / 6):
        return {"before": _acc(before, 48), "after": _acc(after, 48), "chance": chance,
                "change": _iv(*change), "random_change": _iv(*random_change)}  # fmt: skip

    ok = removal(0.77, 0.2, (-0.57, -0.69, -0.42), (-0.01, -0.03, 0.01))
    assert _retrieval_status(ok)[0] == "reproduced"
    above = removal(0.77, 0.5, (-0.27, -0.39, -0.12), (-0.01, -0.03, 0.01))
    assert _retrieval_status(above)[0] == "partly"
    like_random = removal(0.77, 0.5, (-0.27, -0.39, -0.12), (-0.2, -0.3, -0.1))
    assert _retrieval_status(like_random)[0] == "not reproduced"
    noise = removal(0.77, 0.7, (-0.07, -0.15, 0.01), (0.0, -0.01, 0.01))
    assert _retrieval_status(noise)[0] == "not reproduced"
    assert _retrieval_status(removal(0.19, 0.2, (0.0, -0.05, 0.05), (0, 0, 0)))[0] == (
        "not testable offline"
    )


def test_the_shipped_findings_page_records_the_weights_it_measured():
    """docs/findings.{json,md}, as committed, say which weights every model held (issue 17):
    a page regenerated before provenance existed, or by a run that lost it, fails here."""
    import json
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    results = json.loads((docs / "findings.json").read_text(encoding="utf-8"))
    page = (docs / "findings.md").read_text(encoding="utf-8")
    models = {}
    for key in ("1", "2"):
        for r in results[key] if isinstance(results[key], list) else [results[key]]:
            models[r["model"]] = r["provenance"]
    smollm2 = next(m for m in models if m.startswith("SmolLM2-135M"))
    assert {smollm2, "zoo-llama", "zoo-mamba2", "zoo-mamba1", "zoo-bamba"} <= set(models)
    for name, prov in models.items():
        assert prov["source"] in ("gguf", "zoo", "hub", "local") and prov["dtype"], name
        assert prov["description"] in page, name
    assert models[smollm2]["quantization"] in ("Q4_1", "")  # "" only with hub weights


def test_set_level_control_and_every_seed_claim_get_a_status():
    """Issue 30: the set removed together is judged on its joint prose loss (SmolLM2's top 8:
    +1.08 nats/token, random +0.07, must not pass), and every claim of the seeds has a row."""
    from gna_lens.findings.status import SEED_CLAIMS, _set_control_status, seed_claims

    def ctrl(change, rand, half=0.02):
        return {
            "change": _iv(change, change - half, change + half),
            "random_change": _iv(rand, 0, 0.1),
        }

    assert _set_control_status("m", 4, ctrl(0.036, 0.027))["status"] == "reproduced"
    assert _set_control_status("m", 8, ctrl(1.083, 0.067))["status"] == "not reproduced"
    # an interval across the 0.1 margin is inconclusive (issue 39), whatever its point estimate
    assert _set_control_status("m", 4, ctrl(0.036, 0.027, 0.1))["status"] == "inconclusive"
    rows = seed_claims({})
    assert [r["claim"] for r in rows] == [c[0] for c in SEED_CLAIMS]
    assert all(r["status"] and r["why"] for r in rows)
    # A measured claim takes the status of the rows measuring it, conservatively.
    statuses = [
        {"claim": "Removing a few heads drops", "model": "a", "status": "reproduced"},
        {"claim": "Retrieval falls, knowledge", "model": "b", "status": "not reproduced"},
    ]
    first = seed_claims({}, statuses)[0]
    assert first["status"] == "partly" and "a: reproduced; b: not reproduced" in first["why"]


def test_layer_dictionary_and_probe_statuses_follow_their_numbers():
    from gna_lens.findings.status import _dictionary_status, _layers_status, _probe_status

    def single(layer, change, control):
        ctrl = _iv(control, control - 0.02, control + 0.02)
        return {"layer": layer, "change": _iv(*change), "control_change": ctrl}

    base = {"baseline": _acc(0.77, 60), "chance": 1 / 6}
    few = base | {"individual": [single(i, (0.0, -0.05, 0.05), 0.01) for i in range(7)]
                  + [single(7, (-0.4, -0.5, -0.3), 0.05)]}  # fmt: skip
    assert _layers_status("m", few)["status"] == "reproduced"
    breaks_prose = base | {"individual": [single(0, (-0.4, -0.5, -0.3), 2.0)]}
    assert _layers_status("m", breaks_prose)["status"] == "not reproduced"

    def point(n, vs):
        return {"n_pairs": n, "chance": 1 / n, "before": _acc(0.9, 60), "vs_random": _iv(*vs)}

    every = {"points": [point(2, (-0.3, -0.4, -0.2)), point(4, (-0.4, -0.5, -0.3))]}
    assert _dictionary_status("m", every)["status"] == "reproduced"
    some = {"points": [point(2, (-0.3, -0.4, -0.2)), point(4, (-0.05, -0.1, 0.02))]}
    assert _dictionary_status("m", some)["status"] == "partly"

    def probe(acc, overlap):
        return {"model": "m", "template": "facts", "accuracy": _acc(acc, 120), "chance": 1 / 6,
                "top_heads": [{}] * 8, "question_top": [f"L{i}H0" for i in range(8)],
                "overlap": overlap}  # fmt: skip

    assert _probe_status(probe(0.49, ["L0H0"]))["status"] == "partly"
    assert _probe_status(probe(0.49, [f"L{i}H0" for i in range(4)]))["status"] == "reproduced"
    assert _probe_status(probe(0.17, []))["status"] == "not testable offline"
