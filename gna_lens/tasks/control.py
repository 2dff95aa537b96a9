"""Control texts: next-token loss on prose that needs no in-context retrieval.

A head whose removal breaks a retrieval task may simply break the model. The control tells the two
apart: :func:`~gna_lens.score_heads` ablates every head on the task *and* on a control, and ranks
heads by their retrieval effect among those whose control effect stays small.

The default control is English prose that ships with gna_lens (:func:`load_prose`: Jane Austen,
*Persuasion*, volume I, 1818, public domain; see ``gna_lens/data/prose/NOTICE.md``), about 48k
SmolLM2 tokens. :func:`text_control` cuts it (or your own texts, or a ``datasets.Dataset``) into
equal-length token windows. A knowledge task (e.g. cloze questions answered from the weights) is
the other kind of control: pass the :class:`~gna_lens.tasks.Task` itself.
"""

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal, cast

import torch
from jaxtyping import Int
from torch import Tensor

from gna_lens.device import HOST
from gna_lens.errors import GnaLensError, TaskError
from gna_lens.tasks._tokens import tokenizer_name
from gna_lens.tasks.core import Task

__all__ = ["PROSE_SOURCE", "TextControl", "load_prose", "resolve_control", "text_control"]

#: Where the default control text comes from.
PROSE_SOURCE = "Jane Austen, Persuasion, vol. I (1818; public domain)"

Split = Literal["select", "eval", "all"]


@functools.cache
def load_prose() -> str:
    """The English prose shipped with gna_lens: *Persuasion*, volume I (public domain).

    Paragraphs are separated by blank lines. Source, licence and cleaning steps:
    ``gna_lens/data/prose/NOTICE.md``.

    Examples:
        >>> text = load_prose()
        >>> len(text.split()) > 30_000 and text.startswith("Chapter 1")
        True
    """
    path = resources.files("gna_lens").joinpath("data/prose/persuasion.txt")
    return path.read_text(encoding="utf-8")


@dataclass(frozen=True)
class TextControl:
    """Equal-length token windows of a text, for the next-token-loss control.

    Attributes:
        name: A short name (``"prose"``).
        tokens: ``[seq, pos]`` token ids; each row starts with the tokenizer's BOS when it has
            one. The loss is measured on predicting ``tokens[:, 1:]`` (or, for ablations at the
            last position only, on predicting each row's last token from the rest).
        source: Where the text comes from.
        split: Which part of the text the windows come from: ``"select"`` (first half),
            ``"eval"`` (second half; disjoint from ``"select"``) or ``"all"``.
        unknown_fraction: Share of the text's tokens that are the tokenizer's unknown token.
        info: Tokenizer name, window offsets, token counts.
    """

    name: str
    tokens: Int[Tensor, "seq pos"]
    source: str
    split: str = "all"
    unknown_fraction: float = 0.0
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        """Tokens per window."""
        return int(self.tokens.shape[1])

    def describe(self) -> str:
        """``"prose: 8 x 64 tokens of Jane Austen, ... (split select)"``."""
        return (
            f"{self.name}: {len(self)} x {self.seq_len} tokens of {self.source} "
            f"(split {self.split})"
        )

    def __repr__(self) -> str:
        return f"TextControl({self.describe()!r})"


def _texts(texts: Any) -> tuple[list[str], str]:
    """The documents of ``texts`` and a description of where they come from."""
    if texts is None:
        return [load_prose()], PROSE_SOURCE
    if isinstance(texts, str):
        return [texts], "a text passed by the user"
    from datasets import Dataset

    if isinstance(texts, Dataset):
        columns = [c for c, f in texts.features.items() if getattr(f, "dtype", None) == "string"]
        column = "text" if "text" in columns else (columns[0] if len(columns) == 1 else None)
        if column is None:
            raise TaskError(
                f"text_control: the Dataset has string columns {columns} (features "
                f"{list(texts.features)}); expected a 'text' column or exactly one string column. "
                "Fix: dataset.rename_column(<name>, 'text')."
            )
        return [str(t) for t in texts[column]], f"datasets.Dataset column {column!r}"
    if isinstance(texts, Iterable):
        docs = list(texts)
        bad = [type(d).__name__ for d in docs if not isinstance(d, str)]
        if bad or not docs:
            raise TaskError(
                f"text_control(texts=...) got a sequence of {len(docs)} items"
                + (f" including {bad[0]}" if bad else "")
                + "; expected a str, a non-empty list of str, or a datasets.Dataset with a "
                "'text' column."
            )
        return docs, f"{len(docs)} texts passed by the user"
    raise TaskError(
        f"text_control(texts={type(texts).__name__}); expected a str, a list of str or a "
        "datasets.Dataset with a 'text' column (None: the shipped prose)."
    )


def text_control(
    tokenizer: Any,
    texts: str | Sequence[str] | Any = None,
    *,
    n_sequences: int = 8,
    seq_len: int = 64,
    split: Split = "select",
    name: str | None = None,
    max_unknown: float = 0.02,
) -> TextControl:
    """Cut texts into ``n_sequences`` windows of ``seq_len`` tokens for the loss control.

    The documents are tokenized (no special tokens), joined with a blank line, and cut into
    non-overlapping windows spread evenly over the requested part of the token stream; each window
    starts with the tokenizer's BOS when it has one. ``split="select"`` and ``split="eval"`` draw
    from the first and second half of the stream, so the control that selects heads and the one
    that evaluates them never share a token window.

    Args:
        tokenizer: A Hugging Face tokenizer (the model's).
        texts: ``None`` (the shipped prose, :func:`load_prose`), a str, a list of str, or a
            ``datasets.Dataset`` with a ``text`` column.
        n_sequences: Number of windows.
        seq_len: Tokens per window, BOS included.
        split: ``"select"``, ``"eval"`` or ``"all"``.
        name: Name of the control (default ``"prose"`` for the shipped text, else ``"text"``).
        max_unknown: Refuse texts of which more than this share of tokens is the tokenizer's
            unknown token (a word-level tokenizer of a synthetic vocabulary reads prose as
            ``<unk>``; a loss on it measures nothing).

    Returns:
        A :class:`TextControl`.

    Raises:
        TaskError: For texts too short for the windows, a tokenizer that does not cover the
            text, or bad arguments.

    Examples:
        >>> from gna_lens.testing import tiny_tokenizer
        >>> control = text_control(tiny_tokenizer(), n_sequences=4, seq_len=32, max_unknown=1.0)
        >>> tuple(control.tokens.shape), control.split
        ((4, 32), 'select')
        >>> bool((control.tokens != text_control(tiny_tokenizer(), n_sequences=4, seq_len=32,
        ...       split="eval", max_unknown=1.0).tokens).any())
        True
    """
    if not isinstance(n_sequences, int) or n_sequences < 1:
        raise TaskError(f"text_control(n_sequences={n_sequences!r}); expected a positive int.")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise TaskError(f"text_control(seq_len={seq_len!r}); expected an int >= 2.")
    if split not in ("select", "eval", "all"):
        raise TaskError(f"text_control(split={split!r}); expected 'select', 'eval' or 'all'.")
    docs, source = _texts(texts)
    encoded = tokenizer(docs, add_special_tokens=False)["input_ids"]
    sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    stream: list[int] = []
    for ids in encoded:
        if stream:
            stream.extend(sep)
        stream.extend(ids)
    unk = getattr(tokenizer, "unk_token_id", None)
    n_unknown = sum(1 for t in stream if unk is not None and t == unk)
    unknown = n_unknown / max(len(stream), 1)
    tname = tokenizer_name(tokenizer)
    if unknown > max_unknown:
        raise TaskError(
            f"text_control: {100 * unknown:.1f}% of the {len(stream):,} tokens of {source} are "
            f"the unknown token for tokenizer {tname} (max_unknown={max_unknown}); a loss on "
            "them measures nothing. Fix: pass a knowledge task as the control (e.g. "
            "control=gna_lens.zoo.control(tokenizer, 'select') to rank a zoo model, 'eval' to "
            "measure it), texts this tokenizer covers, or control=None to measure no control."
        )
    bos = getattr(tokenizer, "bos_token_id", None)
    adds_bos = bos is not None and tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos]
    body = seq_len - 1 if adds_bos else seq_len
    half = len(stream) // 2
    lo, hi = {"select": (0, half), "eval": (half, len(stream)), "all": (0, len(stream))}[split]
    room = hi - lo
    if room < n_sequences * body:
        raise TaskError(
            f"text_control: {source} gives {len(stream):,} tokens for tokenizer {tname}; split "
            f"{split!r} has {room:,}, but {n_sequences} windows of {body} tokens need "
            f"{n_sequences * body:,}. Fix: longer texts, fewer or shorter windows "
            "(n_sequences=, seq_len=), or split='all'."
        )
    step = room // n_sequences
    starts = [lo + i * step for i in range(n_sequences)]
    rows = [([bos] if adds_bos else []) + stream[s : s + body] for s in starts]
    return TextControl(
        name=name or ("prose" if texts is None else "text"),
        tokens=torch.tensor(rows, dtype=torch.long, device=HOST),
        source=source,
        split=split,
        unknown_fraction=unknown,
        info={
            "tokenizer": tname,
            "stream_tokens": len(stream),
            "starts": starts,
            "bos": adds_bos,
        },
    )


#: What ``control="auto"`` takes for particular tokenizers, before the prose: callables
#: ``(tokenizer, split) -> control or None``. :mod:`gna_lens.zoo` adds its cloze split for the
#: zoo's tokenizer when it is imported (the zoo sits above this module, so it registers itself).
AUTO_CONTROLS: list[Any] = []


def resolve_control(
    control: Any, tokenizer: Any, *, positions: Any = None, split: str = "select"
) -> TextControl | Task | None:
    """The control :func:`~gna_lens.score_heads` measures, from what the user passed.

    Args:
        control: ``"auto"`` (a zoo model's tokenizer: the zoo's cloze split,
            :func:`gna_lens.zoo.control`, named so in the task's name, once :mod:`gna_lens.zoo`
            is imported (:data:`AUTO_CONTROLS`); any other: ``"prose"``),
            ``"prose"`` (the shipped prose: 8 windows of 48 tokens whose last 24 tokens
            are scored to select heads, 64 such windows for the held-out ``split="eval"``, where
            an interval must be narrow enough to decide a 0.1 nats/token margin; 64 windows of
            64 tokens with ``positions="last"``, where each window gives one prediction),
            ``None`` (no control), a :class:`~gna_lens.tasks.TextControl`, a
            :class:`~gna_lens.tasks.Task` (a knowledge task, e.g. cloze questions), a str or list
            of str (texts), or a ``datasets.Dataset`` with a ``text`` column.
        tokenizer: The model's tokenizer.
        positions: The ablated positions (``"last"`` needs more, one-prediction windows).
        split: ``"select"`` or ``"eval"`` (disjoint halves of a text).

    Returns:
        The control, or ``None``.

    Raises:
        TaskError: For texts the tokenizer does not cover, or too short.
        GnaLensError: For a control of another type.
    """
    if control is None or control is False:
        return None
    if isinstance(control, TextControl | Task):
        return control
    if isinstance(control, str) and control == "auto":
        for pick in AUTO_CONTROLS:  # e.g. the zoo's cloze split for the zoo's tokenizer
            chosen = pick(tokenizer, split)
            if chosen is not None:
                return cast("TextControl | Task | None", chosen)
        control = "prose"
    n = 64 if positions == "last" or split == "eval" else 8
    length = 64 if positions == "last" else 48
    prose = isinstance(control, str) and control == "prose"
    if prose and tokenizer is None:
        raise GnaLensError(
            "control='prose' needs the model's tokenizer (model.tokenizer is None). Fix: "
            "attach one, or pass control=gna_lens.tasks.text_control(tokenizer) or a Task."
        )
    is_texts = isinstance(control, str) or (
        isinstance(control, list | tuple) and all(isinstance(t, str) for t in control)
    )
    if not is_texts and type(control).__name__ != "Dataset":
        raise GnaLensError(
            f"control={type(control).__name__}; expected 'prose', None, a TextControl, a Task, "
            "texts (str or list of str) or a datasets.Dataset with a 'text' column."
        )
    texts = None if prose else control
    return text_control(tokenizer, texts, n_sequences=n, seq_len=length, split=split)  # type: ignore[arg-type]
