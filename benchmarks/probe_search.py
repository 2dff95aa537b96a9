"""Search for a KV-retrieval template that SmolLM2-135M-Instruct answers without induction.

The ``"question"`` template ends its query on ``{key}:``, the dictionary line's own prefix, so a
plain induction head (copy the token that followed the last earlier occurrence of the current
token) answers it. Every variant below except the two references is *induction-proof*
(:attr:`gna_lens.tasks.KVTemplate.induction_proof`): the text after the key in the query does
not start the way the dictionary line continues after the key.

Each variant is evaluated on the same seeded prompts (6 word pairs, 60 prompts, seed 0; chance
1/6 over the dictionary's single-token values) and the script prints a markdown table: variant,
the end of its first prompt, accuracy with its 95% Wilson interval, chance, and whether the
interval excludes chance.

Then the registered ``"facts"`` template on held-out prompts (seed 1), and the prefix-matching
(induction) score of every head (:func:`gna_lens.scoring.prefix_matching_scores`): the top 10,
and the heads the findings rank highest on the ``"question"`` template.

Takes ~15 min on one core. Usage:
OMP_NUM_THREADS=1 python benchmarks/probe_search.py [--n 60] [--only NAME ...] [--no-induction]
"""

import argparse
import platform
import time
from typing import Any

import torch

from gna_lens.models import load_model
from gna_lens.scoring import prefix_matching_scores
from gna_lens.stats import wilson_interval
from gna_lens.tasks import KVTemplate, evaluate, kv_retrieval

HEADER = "Below is a list of key-value pairs.\n"
ASK = "What is the value for key {key}?"
CHAT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\n"
)
CHAT_TURN = "<|im_end|>\n<|im_start|>assistant\n"

_DEMO_PAIRS = (("sun", "glass"), ("river", "candle"), ("forest", "button"))
_DEMO_LINES = "".join(f"{k}: {v}\n" for k, v in _DEMO_PAIRS)
DEMO = HEADER + _DEMO_LINES + "What is the value for key river?\nAnswer: candle\n\n"
DEMO_IS = HEADER + _DEMO_LINES + "What is the value for key river?\nThe value is candle\n\n"
DEMO_EQ = HEADER + "".join(f"{k} = {v}\n" for k, v in _DEMO_PAIRS)
DEMO_EQ += "What is the value for key river?\nAnswer: candle\n\n"
DEMO_FACTS = "Below is a list of facts.\n" + "".join(f"The {k} is {v}.\n" for k, v in _DEMO_PAIRS)
DEMO_FACTS += "Question: what is the river?\nAnswer: it is candle.\n\n"

#: name -> (KVTemplate fields, extra kv_retrieval arguments).
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # References (registered templates).
    "question (reference)": ({"template": "question"}, {}),
    "paper (reference)": ({"template": "paper"}, {}),
    "facts (registered: the X is / same line It is)": ({"template": "facts"}, {}),
    # Same dictionary as "question", other query cues.
    "colon / Answer:": ({"header": HEADER, "line": "{key}: {value}\n",
                         "query": ASK + "\nAnswer:"}, {}),
    "colon / The value is": ({"header": HEADER, "line": "{key}: {value}\n",
                              "query": ASK + "\nThe value is"}, {}),
    "colon / value for key X is": ({"header": HEADER, "line": "{key}: {value}\n",
                                    "query": ASK + "\nThe value for key {key} is"}, {}),
    "colon / X's value is": ({"header": HEADER, "line": "{key}: {value}\n",
                              "query": ASK + "\nThe value of {key} is"}, {}),
    "colon / Q: A:": ({"header": HEADER, "line": "{key}: {value}\n",
                       "query": "Q: " + ASK + "\nA:"}, {}),
    # Other separators in the dictionary.
    "equals / Answer:": ({"header": HEADER, "line": "{key} = {value}\n",
                          "query": ASK + "\nAnswer:"}, {}),
    "equals / value of X is": ({"header": HEADER, "line": "{key} = {value}\n",
                                "query": ASK + "\nThe value of {key} is"}, {}),
    "arrow / Answer:": ({"header": HEADER, "line": "{key} -> {value}\n",
                         "query": ASK + "\nAnswer:"}, {}),
    "arrow / X maps to": ({"header": "Below is a mapping from keys to values.\n",
                           "line": "{key} -> {value}\n",
                           "query": "Which value does {key} map to?\n{key} maps to"}, {}),
    "is / X is": ({"header": "Below is a list of facts.\n", "line": "The {key} is {value}.\n",
                   "query": "Question: what is the {key}?\nAnswer: it is"}, {}),
    # The chat format (SmolLM2's template, written out; its BOS is <|im_start|>, so the
    # tokenizer's own BOS is not added).
    "chat colon / The value is": ({"header": CHAT_SYSTEM + HEADER, "line": "{key}: {value}\n",
                                   "query": ASK + CHAT_TURN + "The value is"},
                                  {"add_special_tokens": False}),
    "chat colon / value for key X is": ({"header": CHAT_SYSTEM + HEADER,
                                         "line": "{key}: {value}\n",
                                         "query": ASK + CHAT_TURN + "The value for key {key} is"},
                                        {"add_special_tokens": False}),
    "chat equals / value of X is": ({"header": CHAT_SYSTEM + HEADER, "line": "{key} = {value}\n",
                                     "query": ASK + CHAT_TURN + "The value of {key} is"},
                                    {"add_special_tokens": False}),
    # Round 2: a worked example first (a fixed three-pair dictionary, its question and answer),
    # and sentence-style lines.
    "demo colon / Answer:": ({"header": DEMO + HEADER, "line": "{key}: {value}\n",
                              "query": ASK + "\nAnswer:"}, {}),
    "demo colon / The value is": ({"header": DEMO_IS + HEADER, "line": "{key}: {value}\n",
                                   "query": ASK + "\nThe value is"}, {}),
    "demo equals / Answer:": ({"header": DEMO_EQ + HEADER, "line": "{key} = {value}\n",
                               "query": ASK + "\nAnswer:"}, {}),
    "the X is / It is": ({"header": "Below is a list of facts.\n",
                          "line": "The {key} is {value}.\n",
                          "query": "What is the {key}?\nIt is"}, {}),
    "X is / Answer: it is": ({"header": "Below is a list of facts.\n",
                              "line": "{key} is {value}.\n",
                              "query": "Question: what is {key}?\nAnswer: it is"}, {}),
    "the X is / Answer: it is (no header)": ({"header": "", "line": "The {key} is {value}.\n",
                                              "query": "Question: what is the {key}?\n"
                                                       "Answer: it is"}, {}),
    "demo the X is / Answer: it is": ({"header": DEMO_FACTS + "Below is a list of facts.\n",
                                       "line": "The {key} is {value}.\n",
                                       "query": "Question: what is the {key}?\nAnswer: it is"},
                                      {}),
    # Round 3: sentence-style lines ("The {key} is {value}."), other questions and cues.
    "the X is / It is (no header)": ({"header": "", "line": "The {key} is {value}.\n",
                                      "query": "What is the {key}?\nIt is"}, {}),
    "the X is / same line It is": ({"header": "Below is a list of facts.\n",
                                    "line": "The {key} is {value}.\n",
                                    "query": "What is the {key}? It is"}, {}),
    "the X is / The answer is": ({"header": "Below is a list of facts.\n",
                                  "line": "The {key} is {value}.\n",
                                  "query": "What is the {key}?\nThe answer is"}, {}),
    "the X is / Q: A: It is": ({"header": "Below is a list of facts.\n",
                                "line": "The {key} is {value}.\n",
                                "query": "Q: What is the {key}?\nA: It is"}, {}),
    "the X is / remember": ({"header": "Remember these facts.\n",
                             "line": "The {key} is {value}.\n",
                             "query": "What is the {key}?\nIt is"}, {}),
    "my X is / It is": ({"header": "Below is a list of facts about me.\n",
                         "line": "My {key} is {value}.\n",
                         "query": "What is my {key}?\nIt is"}, {}),
    "chat the X is / It is": ({"header": CHAT_SYSTEM + "Below is a list of facts.\n",
                               "line": "The {key} is {value}.\n",
                               "query": "What is the {key}?" + CHAT_TURN + "It is"},
                              {"add_special_tokens": False}),
    "the X is / It is, 4 pairs": ({"header": "Below is a list of facts.\n",
                                   "line": "The {key} is {value}.\n",
                                   "query": "What is the {key}?\nIt is"}, {"n_pairs": 4}),
    # Round 4: around the best so far (the question and its cue on one line).
    "the X is / same line, no header": ({"header": "", "line": "The {key} is {value}.\n",
                                         "query": "What is the {key}? It is"}, {}),
    "my X is / same line": ({"header": "Below is a list of facts about me.\n",
                             "line": "My {key} is {value}.\n",
                             "query": "What is my {key}? It is"}, {}),
    "the X is / same line Q: A:": ({"header": "Below is a list of facts.\n",
                                    "line": "The {key} is {value}.\n",
                                    "query": "Q: What is the {key}? A: It is"}, {}),
    "the X was / same line": ({"header": "Below is a list of facts.\n",
                               "line": "The {key} was {value}.\n",
                               "query": "What was the {key}? It was"}, {}),
}  # fmt: skip


def build(tok: Any, fields: dict[str, Any], extra: dict[str, Any], name: str, n: int) -> Any:
    tpl: Any = fields["template"] if "template" in fields else KVTemplate(**fields, name=name)
    kw = dict(n_pairs=6, values="words", n_samples=n, seed=0) | extra
    return kv_retrieval(tok, template=tpl, **kw)


def evaluate_row(model: Any, name: str, task: Any) -> str:
    """One markdown row: variant, induction-proof, prompt tail, accuracy [95% Wilson], chance."""
    tpl = task.info["kv_template"]
    res = evaluate(model, task, batch_size=16, progress=False)
    iv = wilson_interval(int(res.correct.sum()), len(res))
    tail = task[0].prompt[-60:].replace("\n", "\\n").replace("|", "\\|")
    return (
        f"| {name} | {'yes' if tpl.induction_proof else 'no'} | `...{tail}` | "
        f"{iv.value:.2f} [{iv.low:.2f}, {iv.high:.2f}] | {res.chance:.3f} | "
        f"{'yes' if iv.low > res.chance else 'no'} |"
    )


#: The heads the findings ranked highest on the "question" template (issue 30).
FINDINGS_TOP = [(16, 0), (18, 6), (8, 2), (17, 2), (0, 6), (0, 8), (2, 2), (0, 7)]


def induction_table(model: Any) -> None:
    """Prefix-matching scores of every head: the top 10 and the findings' top 8."""
    t0 = time.perf_counter()
    scores = prefix_matching_scores(model, n_tokens=50, n_samples=16, seed=0, batch_size=8)
    df = scores.to_dataframe()
    df["rank"] = df["prefix_matching"].rank(ascending=False, method="min").astype(int)
    df = df.set_index(["layer", "head"])
    print(
        f"\nPrefix-matching scores ({len(df)} heads; 16 x 50 random tokens repeated twice after "
        f"BOS={scores.bos}; uniform-head baseline {scores.baseline:.4f}; "
        f"{time.perf_counter() - t0:.0f} s)\n"
    )
    print("| head | prefix matching | previous token | rank |")
    print("|---|---|---|---|")
    shown = [*scores.top(10), *(h for h in FINDINGS_TOP if h not in scores.top(10))]
    for i, (layer, head) in enumerate(shown):
        if i == 10:
            print("| *findings' top 8 (question template)* | | | |")
        row = df.loc[(layer, head)]
        print(
            f"| L{layer}H{head} | {row['prefix_matching']:.3f} | {row['previous_token']:.3f} | "
            f"{row['rank']} |"
        )
    print("\nThe findings' top 8:", ", ".join(
        f"L{lay}H{h} {df.loc[(lay, h), 'prefix_matching']:.3f} (#{df.loc[(lay, h), 'rank']})"
        for lay, h in FINDINGS_TOP
    ))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=60, help="prompts per variant")
    ap.add_argument("--only", nargs="*", default=None, help="variant names to run")
    ap.add_argument("--holdout", type=int, default=120, help="held-out prompts (seed 1) of 'facts'")
    ap.add_argument("--no-induction", action="store_true", help="skip the prefix-matching scores")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("smollm2-135m")
    tok = model.tokenizer
    cpu = platform.processor() or platform.machine()
    print(
        f"SmolLM2-135M-Instruct (Q4_1 GGUF, float32), {cpu}, {args.threads} thread(s); 6 word "
        f"pairs unless the variant says otherwise, {args.n} prompts (seed 0) per variant.\n"
    )
    print("| variant | induction-proof | prompt tail | accuracy [95% Wilson] | chance | > chance |")
    print("|---|---|---|---|---|---|")
    for name, (fields, extra) in VARIANTS.items():
        if args.only is None or name in args.only:
            print(evaluate_row(model, name, build(tok, fields, extra, name, args.n)), flush=True)
    if args.holdout:
        held = kv_retrieval(
            tok, n_pairs=6, values="words", n_samples=args.holdout, seed=1, template="facts"
        )
        print(f"\nHeld out ({args.holdout} prompts, seed 1):\n")
        print(evaluate_row(model, "facts, held out", held), flush=True)
    if not args.no_induction:
        induction_table(model)


if __name__ == "__main__":
    main()
