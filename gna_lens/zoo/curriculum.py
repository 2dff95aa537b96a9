"""The zoo's synthetic curriculum: in-context retrieval plus a fixed world of facts.

Two skills, chosen so that the Gather-and-Aggregate story can be told on tiny models:

- **In-context retrieval**: key-value dictionaries in the G&A paper's template
  (``"paper"`` of :data:`gna_lens.tasks.KV_TEMPLATES`), 1 to 16 pairs, keys drawn from a fixed pool
  of English nouns, values the integers 0-99.
- **Parametric knowledge**: a fixed *world* of facts ``(entity, relation) -> attribute`` about
  made-up entities (``"What color is Bomek?"`` -> ``"red"``), learned in the weights. Questions
  are asked three ways: bare (``"...?\\nAnswer: red"``), multiple choice scored on the option's
  text (cloze) and multiple choice scored on its letter (``" A"`` .. ``" D"``, MMLU format).

The facts are split: every fact is trained in bare and cloze form, but only the ``letter-train``
facts are ever trained in letter form. The held-out ``letter`` evaluation asks the other facts in
letter form, so answering it needs both the fact (from the weights) and an in-context look-up of
which option line holds it (the Gather-and-Aggregate mechanism); the ``cloze`` evaluation asks
the same prompts scored on the option's text, which needs only the fact.

The world is frozen in ``world.json`` next to this module, so every zoo checkpoint and every
user sees the same facts.
"""

import functools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from gna_lens.device import HOST
from gna_lens.errors import TaskError
from gna_lens.tasks import KV_TEMPLATES, MCRecord, Task, format_question, kv_retrieval
from gna_lens.tasks import multiple_choice as _multiple_choice

__all__ = [
    "EVAL_TASKS",
    "KV_TEMPLATE",
    "Fact",
    "World",
    "build_tokenizer",
    "eval_tasks",
    "load_world",
    "make_world",
    "tokenize_document",
    "training_batches",
    "training_document",
]

#: The KV-retrieval template of the curriculum (the G&A paper's probe).
KV_TEMPLATE = KV_TEMPLATES["paper"]
#: Dictionary sizes seen in training.
KV_MAX_PAIRS = 16
#: Queries per training dictionary (at most one per key).
KV_QUERIES = 8
#: Names of the held-out evaluation tasks, in card order.
EVAL_TASKS = ("kv-2", "kv-4", "kv-8", "kv-16", "cloze", "letter", "letter-unseen")
#: Seeds and sizes of the held-out evaluation splits (never used by training's generator).
EVAL_SEED = 10_000
KV_EVAL_SAMPLES = 200
MC_EVAL_DRAWS = 3

_RELATIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "color": (
        "What color is {entity}?",
        ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "brown", "pink",
         "gray", "gold"),
    ),
    "city": (
        "Where does {entity} live?",
        ("Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Rome", "Delhi", "Seoul", "Dublin", "Quito",
         "Hanoi", "Madrid"),
    ),
    "food": (
        "What does {entity} eat?",
        ("apples", "bread", "rice", "cheese", "soup", "fish", "honey", "salad", "pasta", "cake",
         "beans", "corn"),
    ),
}  # fmt: skip
_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
_WORD_RE = r" ?[A-Za-z0-9_]+| ?[^\sA-Za-z0-9_]|\n| "


@dataclass(frozen=True)
class Fact:
    """One fact of the world.

    Attributes:
        entity: The made-up entity (a single token, capitalized).
        relation: ``"color"``, ``"city"`` or ``"food"``.
        attribute: The true attribute.
        letter_train: Whether the fact is ever trained in letter (MMLU) format.
    """

    entity: str
    relation: str
    attribute: str
    letter_train: bool

    @property
    def question(self) -> str:
        """The question about this fact."""
        return _RELATIONS[self.relation][0].format(entity=self.entity)


@dataclass(frozen=True)
class World:
    """The curriculum's frozen vocabulary and facts.

    Attributes:
        keys: The KV-retrieval keys (English nouns, single tokens for the zoo tokenizer).
        entities: The made-up entities.
        facts: Every fact (entity x relation).
        relations: Relation name -> (question template, attribute pool).
        seed: The seed the world was generated with.
    """

    keys: tuple[str, ...]
    entities: tuple[str, ...]
    facts: tuple[Fact, ...]
    relations: dict[str, tuple[str, tuple[str, ...]]]
    seed: int

    def records(self, which: str = "all", *, draws: int = 1, seed: int = 0) -> list[MCRecord]:
        """Multiple-choice records of the facts: the true attribute and three distractors.

        Args:
            which: ``"all"``, ``"letter-train"`` or ``"held-out"`` (facts never trained in letter
                format).
            draws: How many records per fact (each with its own distractors and order).
            seed: Seed of the distractors and order.

        Returns:
            The records (``subject`` is the relation, ``id`` is ``"<entity>/<relation>/<draw>"``).
        """
        facts = self.select(which)
        rng = random.Random(seed)
        out = []
        for d in range(draws):
            for f in facts:
                pool = [a for a in self.relations[f.relation][1] if a != f.attribute]
                options = [f.attribute, *rng.sample(pool, 3)]
                rng.shuffle(options)
                out.append(
                    MCRecord(
                        question=f.question,
                        options=tuple(options),
                        answer=options.index(f.attribute),
                        subject=None,
                        id=f"{f.entity}/{f.relation}/{d}",
                    )
                )
        return out

    def select(self, which: str) -> list[Fact]:
        """The facts of a split: ``"all"``, ``"letter-train"`` or ``"held-out"``."""
        if which == "all":
            return list(self.facts)
        if which == "letter-train":
            return [f for f in self.facts if f.letter_train]
        if which == "held-out":
            return [f for f in self.facts if not f.letter_train]
        raise TaskError(f"which={which!r}; expected 'all', 'letter-train' or 'held-out'.")

    def vocabulary(self) -> list[str]:
        """Every piece of text the curriculum writes, for the word-level tokenizer."""
        texts = [
            *(t.render_prompt([("key", "0")], "key")[0] for t in KV_TEMPLATES.values()),
            "Answer:",
            *self.keys,
            *self.entities,
        ]
        for template, pool in self.relations.values():
            texts.append(template.format(entity="X"))
            texts.extend(pool)
        return texts

    def to_json(self) -> str:
        """The world as JSON (what ``world.json`` holds)."""
        return json.dumps(
            {
                "seed": self.seed,
                "keys": list(self.keys),
                "entities": list(self.entities),
                "relations": {k: [t, list(p)] for k, (t, p) in self.relations.items()},
                "facts": [[f.entity, f.relation, f.attribute, f.letter_train] for f in self.facts],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> "World":
        """Read a world written by :meth:`to_json`."""
        d = json.loads(text)
        return cls(
            keys=tuple(d["keys"]),
            entities=tuple(d["entities"]),
            facts=tuple(Fact(e, r, a, bool(t)) for e, r, a, t in d["facts"]),
            relations={k: (t, tuple(p)) for k, (t, p) in d["relations"].items()},
            seed=int(d["seed"]),
        )


def _pseudo_words(n: int, rng: random.Random) -> list[str]:
    cons, vows = "bdfgklmnprstvz", "aeiou"
    out: set[str] = set()
    while len(out) < n:
        w = "".join(rng.choice(cons) + rng.choice(vows) for _ in range(2)) + rng.choice(cons)
        out.add(w.capitalize())
    return sorted(out)


def make_world(
    seed: int = 0, *, n_entities: int = 100, n_keys: int = 200, letter_train_frac: float = 0.8
) -> World:
    """Generate a world: ``n_entities`` entities x 3 relations facts, and a pool of KV keys.

    Args:
        seed: Seed of every draw.
        n_entities: Number of made-up entities (each has one attribute per relation).
        n_keys: Number of KV-retrieval keys drawn from :func:`gna_lens.tasks.load_words`.
        letter_train_frac: Fraction of facts trained in letter format.

    Returns:
        The world.

    Examples:
        >>> w = make_world(0, n_entities=4, n_keys=10)
        >>> len(w.facts), len(w.keys), w.facts[0].question.startswith("What color is")
        (12, 10, True)
    """
    from gna_lens.tasks import load_words

    rng = random.Random(seed)
    attributes = {a for _, pool in _RELATIONS.values() for a in pool}
    words = [w for w in load_words() if w.isalpha() and w.islower() and w not in attributes]
    keys = tuple(sorted(rng.sample(words, n_keys)))
    entities = tuple(_pseudo_words(n_entities, rng))
    pairs = [(e, rel) for e in entities for rel in _RELATIONS]
    held_out = set(rng.sample(pairs, round(len(pairs) * (1 - letter_train_frac))))
    facts = [
        Fact(e, rel, rng.choice(_RELATIONS[rel][1]), (e, rel) not in held_out) for e, rel in pairs
    ]
    return World(keys=keys, entities=entities, facts=tuple(facts), relations=_RELATIONS, seed=seed)


@functools.cache
def load_world() -> World:
    """The world shipped with gna_lens (``gna_lens/zoo/world.json``), the one the zoo learned.

    Examples:
        >>> w = load_world()
        >>> len(w.facts), len(w.select("held-out")) < len(w.select("letter-train"))
        (300, True)
    """
    text = resources.files("gna_lens.zoo").joinpath("world.json").read_text(encoding="utf-8")
    return World.from_json(text)


def build_tokenizer(world: World) -> Any:
    """A word-level tokenizer over the curriculum's vocabulary, with a BOS token.

    Words and single punctuation marks (each with or without one leading space), the numbers
    0-99, capital letters, ``\\n`` and bare spaces are tokens; anything else is ``<unk>``. So every
    key, value, entity, attribute and letter is one token, and each line ends with its ``\\n``.

    Examples:
        >>> tok = build_tokenizer(make_world(0, n_entities=2, n_keys=4))
        >>> tok.convert_ids_to_tokens(tok("Answer: red\\n")["input_ids"])
        ['<s>', 'Answer', ':', ' red', '\\n']
    """
    import re
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from gna_lens.tasks.toy_tokenizers import wrap_fast

    vocab: dict[str, int] = {s: i for i, s in enumerate(_SPECIALS)}
    pieces = ["\n", " ", *string.ascii_uppercase, *string.punctuation]
    pieces += [str(n) for n in range(100)]
    for text in world.vocabulary():
        pieces += [p.lstrip(" ") for p in re.findall(_WORD_RE, text)]
    for p in pieces:
        vocab.setdefault(p, len(vocab))
        if p not in ("\n", " "):
            vocab.setdefault(" " + p, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_WORD_RE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return wrap_fast(tok, bos=True)


# ----------------------------------------------------------------------------- training data
def _kv_document(world: World, rng: random.Random, n_pairs: int, n_queries: int) -> list[str]:
    keys = rng.sample(world.keys, n_pairs)
    values = rng.sample([str(v) for v in range(100)], n_pairs)
    order = rng.sample(range(n_pairs), min(n_queries, n_pairs))
    prompt, _, _, _ = KV_TEMPLATE.render_prompt(
        list(zip(keys, values, strict=True)), keys[order[0]]
    )
    parts = [prompt, KV_TEMPLATE.render_answer(values[order[0]])]
    for q in order[1:]:
        parts += [
            "\n" + KV_TEMPLATE.query.format(key=keys[q]),
            KV_TEMPLATE.render_answer(values[q]),
        ]
    return parts


def _fact_document(world: World, rng: random.Random, n_questions: int) -> list[str]:
    parts: list[str] = []
    for i in range(n_questions):
        f = rng.choice(world.facts)
        kinds = ["bare", "cloze"] + (["letter", "letter"] if f.letter_train else [])
        kind = rng.choice(kinds)
        sep = "\n\n" if i else ""
        if kind == "bare":
            text, _ = format_question(f.question, [])
            parts += [sep + text, " " + f.attribute]
            continue
        pool = [a for a in world.relations[f.relation][1] if a != f.attribute]
        options = [f.attribute, *rng.sample(pool, 3)]
        rng.shuffle(options)
        text, _ = format_question(f.question, options)
        answer = " " + ("ABCD"[options.index(f.attribute)] if kind == "letter" else f.attribute)
        parts += [sep + text, answer]
    return parts


def training_document(
    world: World, rng: random.Random, kind: str | None = None, n_pairs: int | None = None
) -> list[str]:
    """One training document as alternating ``[context, answer, context, answer, ...]`` texts.

    The loss is taken on the answers only. A KV document is a dictionary of 1 to 16 pairs
    followed by up to 8 queries of distinct keys (the first one is exactly a
    :func:`~gna_lens.tasks.kv_retrieval` prompt). With 8 pairs or fewer every key is queried
    once, so the last answer can be had by elimination (the one value not yet answered) rather
    than by retrieval; the held-out evaluation asks a single query, where it cannot. A fact
    document is 2 to 4 questions separated
    by a blank line, each bare, cloze or (for letter-train facts, twice as often) letter.

    Args:
        world: The world.
        rng: The random generator (training uses its own seed, never an evaluation seed).
        kind: ``"kv"``, ``"facts"`` or ``None`` (either, with equal probability).
        n_pairs: The dictionary size of a KV document (default: drawn from 1 to 16).

    Examples:
        >>> w = make_world(0, n_entities=4, n_keys=20)
        >>> parts = training_document(w, random.Random(0), "kv")
        >>> parts[0].startswith("Memorize the following dictionary:\\n"), parts[1][0] == " "
        (True, True)
    """
    kind = kind or rng.choice(["kv", "facts"])
    if kind == "kv":
        return _kv_document(world, rng, n_pairs or rng.randint(1, KV_MAX_PAIRS), KV_QUERIES)
    if kind == "facts":
        return _fact_document(world, rng, rng.randint(2, 4))
    raise TaskError(f"kind={kind!r}; expected 'kv', 'facts' or None.")


def tokenize_document(tokenizer: Any, parts: Sequence[str]) -> tuple[list[int], list[int]]:
    """Token ids and labels (``-100`` except on answer tokens) of a training document."""
    ids: list[int] = list(tokenizer("")["input_ids"])  # the BOS
    labels = [-100] * len(ids)
    for i, text in enumerate(parts):
        t = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += t
        labels += t if i % 2 else [-100] * len(t)
    return ids, labels


def training_batches(
    world: World, tokenizer: Any, batch_size: int, seed: int, kv_fraction: float = 0.5
) -> Iterator[tuple[Any, Any, Any]]:
    """Endless ``(input_ids, attention_mask, labels)`` batches, right-padded.

    Each batch is all KV documents (one dictionary size per batch, so padding stays small) or
    all fact documents, interleaved evenly so that a fraction ``kv_fraction`` of the batches
    are KV (0.5: they alternate, starting with KV).

    Raises:
        TaskError: If ``kv_fraction`` is not in ``(0, 1]``.
    """
    import math

    import torch

    if not 0 < kv_fraction <= 1:
        raise TaskError(
            f"kv_fraction={kv_fraction!r}; expected a fraction in (0, 1] (0.5: half the batches "
            "are KV retrieval)."
        )
    rng = random.Random(seed)
    pad = tokenizer.pad_token_id
    step = 0
    while True:
        is_kv = math.floor(step * kv_fraction) != math.floor((step - 1) * kv_fraction)
        kind = "kv" if is_kv else "facts"
        n_pairs = rng.randint(1, KV_MAX_PAIRS) if kind == "kv" else None
        rows = [
            tokenize_document(tokenizer, training_document(world, rng, kind, n_pairs))
            for _ in range(batch_size)
        ]
        n = max(len(r[0]) for r in rows)
        # A dataset on the host; the training loop puts each batch on the model's device.
        ids = [r + [pad] * (n - len(r)) for r, _ in rows]
        mask = [[1] * len(r) + [0] * (n - len(r)) for r, _ in rows]
        labels = [lab + [-100] * (n - len(lab)) for _, lab in rows]
        yield (
            torch.tensor(ids, dtype=torch.long, device=HOST),
            torch.tensor(mask, dtype=torch.long, device=HOST),
            torch.tensor(labels, dtype=torch.long, device=HOST),
        )
        step += 1


# ----------------------------------------------------------------------------- evaluation
def eval_tasks(tokenizer: Any, world: World | None = None) -> dict[str, Task]:
    """The held-out evaluation splits the zoo's cards report, built with :mod:`gna_lens.tasks`.

    - ``"kv-2"``, ``"kv-4"``, ``"kv-8"``, ``"kv-16"``: :func:`~gna_lens.tasks.kv_retrieval` in
      the paper's template over the world's keys, values 0-99, 200 prompts each, scored over the
      dictionary's values (chance ``1/n_pairs``), seeds never used in training.
    - ``"letter"``: every fact as an MMLU-format question with fresh distractors and order (an
      evaluation seed), scored on ``" A"`` .. ``" D"`` (chance 25%). The fact comes from the
      weights; which letter holds it must be looked up in context.
    - ``"cloze"``: the very same prompts scored on the option's text (chance 25%): the fact alone.
    - ``"letter-unseen"``: the facts never trained in letter format, three draws each, scored on
      the letter: the letter skill transferred to facts only ever seen bare or in cloze form.

    Args:
        tokenizer: A HF fast tokenizer (the zoo's, or any that keeps the world's words whole).
        world: The world; defaults to :func:`load_world`.

    Returns:
        ``{name: Task}`` in :data:`EVAL_TASKS` order.
    """
    world = world or load_world()
    out: dict[str, Task] = {}
    for n in (2, 4, 8, 16):
        out[f"kv-{n}"] = kv_retrieval(
            tokenizer,
            n_pairs=n,
            n_samples=KV_EVAL_SAMPLES,
            seed=EVAL_SEED + n,
            template=KV_TEMPLATE,
            words=world.keys,
        )
    records = world.records("all", draws=1, seed=EVAL_SEED)
    out["cloze"] = _multiple_choice(records, tokenizer, format="cloze")
    out["letter"] = _multiple_choice(records, tokenizer, format="letter")
    unseen = world.records("held-out", draws=MC_EVAL_DRAWS, seed=EVAL_SEED + 1)
    out["letter-unseen"] = _multiple_choice(unseen, tokenizer, format="letter")
    return out
