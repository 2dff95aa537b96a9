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
