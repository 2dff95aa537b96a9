"""Samples, tasks and padded batches: prompts whose structure is known token by token."""

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, overload

import torch
from jaxtyping import Int
from torch import Tensor

from gna_lens.device import HOST
from gna_lens.errors import TaskError
from gna_lens.tasks._tokens import Encoding, continuations, encode, tokenizer_name

__all__ = ["Batch", "Sample", "Task", "build_sample", "build_samples"]

Scoring = Literal["choices", "exact"]
_CHUNK = 128
PaddingSide = Literal["left", "right"]


def _plain(value: Any) -> Any:
    """``value`` with every tuple and list made a list, recursively."""
    return [_plain(v) for v in value] if isinstance(value, list | tuple) else value


@dataclass(frozen=True)
class Sample:
    """One prompt with its token-level structure.

    Attributes:
        prompt: The prompt text (what the model reads, before tokenization).
        input_ids: The prompt's token ids for the task's tokenizer, BOS included when the
            tokenizer adds one.
        segments: Half-open token ranges ``(start, end)`` of the segments (the dictionary lines
            of KV retrieval, the option lines of multiple choice). A token straddling two
            segments' boundary belongs to both.
        segment_chars: Half-open character ranges of the segments in ``prompt``.
        summary_positions: The last token of each segment, e.g. the token holding the line's
            ``\\n`` (the Gather head's summary token).
        query_position: The final prompt token, where the answer is predicted (the Aggregate
            head's query).
        answer_segment: Index of the segment that holds the answer.
        choices: The candidate continuations, as text (e.g. ``" 84"``, ``" B"``).
        choice_ids: The token ids of each choice as tokenized right after the prompt.
        answer_index: Index of the correct choice in ``choices``.
        info: Task-specific metadata (the keys and values of a dictionary, the subject of a
            question, ...).
    """

    prompt: str
    input_ids: list[int]
    segments: list[tuple[int, int]]
    segment_chars: list[tuple[int, int]]
    summary_positions: list[int]
    query_position: int
    answer_segment: int
    choices: list[str]
    choice_ids: list[list[int]]
    answer_index: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def answer(self) -> str:
        """The correct continuation, as text."""
        return self.choices[self.answer_index]

    @property
    def answer_ids(self) -> list[int]:
        """The token ids of the correct continuation."""
        return self.choice_ids[self.answer_index]

    @property
    def n_tokens(self) -> int:
        """The prompt's length in tokens."""
        return len(self.input_ids)

    @property
    def single_token_choices(self) -> bool:
        """Whether every choice is one token (then one forward pass scores them all)."""
        return all(len(c) == 1 for c in self.choice_ids)

    def segment_text(self, i: int) -> str:
        """The text of segment ``i``."""
        s, e = self.segment_chars[i]
        return self.prompt[s:e]

    def to_dict(self) -> dict[str, Any]:
        """A plain-``dict`` row (the one :meth:`Task.to_dataset` writes)."""
        row = {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "info"}
        row["answer_ids"] = list(self.answer_ids)
        for k, v in self.info.items():
            row[k if k not in row else f"info_{k}"] = v
        return row


@dataclass(frozen=True)
class Batch:
    """Padded samples, with every span shifted to its padded position.

    Attributes:
        input_ids: Token ids, padded with the pad token.
        attention_mask: 1 on real tokens, 0 on padding.
        samples: The samples in the batch.
        indices: Each sample's index in its task.
        offsets: How far each row was shifted by left padding (0 with right padding).
        segments: Each row's segments, shifted.
        summary_positions: Each row's summary positions, shifted.
        query_positions: Each row's query position, shifted.
        answer_segments: Each row's answer segment.
        padding_side: ``"left"`` or ``"right"``.
    """

    input_ids: Int[Tensor, "batch pos"]
    attention_mask: Int[Tensor, "batch pos"]
    samples: tuple[Sample, ...]
    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    segments: tuple[tuple[tuple[int, int], ...], ...]
    summary_positions: tuple[tuple[int, ...], ...]
    query_positions: Int[Tensor, " batch"]
    answer_segments: Int[Tensor, " batch"]
    padding_side: PaddingSide

    def __len__(self) -> int:
        return len(self.samples)


def pad_sequences(
    seqs: Sequence[Sequence[int]],
    *,
    padding_side: PaddingSide,
    pad_token_id: int,
    device: torch.device | str = HOST,
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"], list[int]]:
    """Pad id lists into a tensor; returns ``(input_ids, attention_mask, left_offsets)``.

    The ids and mask are made on ``device`` (the host by default; the model's device for a batch
    that is fed to a model), each in one transfer.
    """
    if padding_side not in ("left", "right"):
        raise TaskError(f"padding_side={padding_side!r}; expected 'left' or 'right'.")
    width = max(len(s) for s in seqs)
    pad = int(pad_token_id)
    ids: list[list[int]] = []
    mask: list[list[int]] = []
    offsets = []
    for s in seqs:
        off = width - len(s) if padding_side == "left" else 0
        tail = width - off - len(s)
        ids.append([pad] * off + [int(t) for t in s] + [pad] * tail)
        mask.append([0] * off + [1] * len(s) + [0] * tail)
        offsets.append(off)
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(mask, dtype=torch.long, device=device),
        offsets,
    )


def default_pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad token, else its EOS, else 0 (padding is masked anyway)."""
    for name in ("pad_token_id", "eos_token_id"):
        tid = getattr(tokenizer, name, None)
        if isinstance(tid, int):
            return tid
    return 0


@dataclass(frozen=True, eq=True)
class Task(Sequence[Sample]):
    """A sequence of :class:`Sample` plus how to score them.

    Attributes:
        samples: The samples.
        name: A short description (task kind and its main parameters).
        scoring: ``"choices"``: multiple choice by log-likelihood over ``sample.choices``
            (chance ``1/len(choices)``); ``"exact"``: the model's argmax continuation must be the
            answer.
        length_normalize: For multi-token choices: ``False`` sums the log-probs of a choice's
            tokens, ``"tokens"`` (or ``True``) averages them per token, ``"chars"`` divides the
            sum by the choice's length in characters.
        pad_token_id: The id used to pad batches (from the tokenizer: pad, else EOS, else 0).
        info: The parameters the task was built with.
        tokenizer: The tokenizer the samples were tokenized with (not compared, not shown).
    """

    samples: tuple[Sample, ...]
    name: str
    scoring: Scoring = "choices"
    length_normalize: bool | Literal["tokens", "chars"] = False
    pad_token_id: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.scoring not in ("choices", "exact"):
            raise TaskError(f"scoring={self.scoring!r}; expected 'choices' or 'exact'.")
        if self.length_normalize not in (False, True, "tokens", "chars"):
            raise TaskError(
                f"length_normalize={self.length_normalize!r}; expected False, True/'tokens' "
                "(mean log-prob per token) or 'chars' (summed log-prob per character)."
            )
        object.__setattr__(self, "samples", tuple(self.samples))

    def __len__(self) -> int:
        return len(self.samples)

    @overload
    def __getitem__(self, i: int) -> Sample: ...
    @overload
    def __getitem__(self, i: slice) -> "Task": ...
    def __getitem__(self, i: int | slice) -> "Sample | Task":
        if isinstance(i, slice):
            return replace(self, samples=self.samples[i])
        return self.samples[i]

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __repr__(self) -> str:
        return f"Task({self.name!r}, n_samples={len(self)}, scoring={self.scoring!r})"

    @property
    def chance(self) -> float:
        """Expected accuracy of guessing uniformly among the choices (0 for exact match)."""
        if self.scoring == "exact" or not self.samples:
            return 0.0
        return sum(1.0 / len(s.choices) for s in self.samples) / len(self.samples)

    def to_dataset(self) -> Any:
        """The samples as a ``datasets.Dataset``, one row per sample (see :meth:`Sample.to_dict`)."""
        import datasets

        return datasets.Dataset.from_list([s.to_dict() for s in self.samples])

    def batches(
        self,
        batch_size: int = 8,
        *,
        padding_side: PaddingSide = "right",
        pad_token_id: int | None = None,
    ) -> Iterator[Batch]:
        """Iterate over padded batches, in order.

        Args:
            batch_size: Samples per batch.
            padding_side: ``"right"`` keeps every span where it is; ``"left"`` shifts each row's
                spans by its pad count (``batch.offsets``) so ``query_positions`` are all the
                last column.
            pad_token_id: Pad id; defaults to ``task.pad_token_id``.

        Yields:
            :class:`Batch` objects.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise TaskError(f"batch_size={batch_size!r}; expected a positive int.")
        pad = self.pad_token_id if pad_token_id is None else int(pad_token_id)
        for start in range(0, len(self.samples), batch_size):
            chunk = self.samples[start : start + batch_size]
            ids, mask, offsets = pad_sequences(
                [s.input_ids for s in chunk], padding_side=padding_side, pad_token_id=pad
            )
            moved = list(zip(chunk, offsets, strict=True))
            yield Batch(
                input_ids=ids,
                attention_mask=mask,
                samples=chunk,
                indices=tuple(range(start, start + len(chunk))),
                offsets=tuple(offsets),
                segments=tuple(tuple((a + o, b + o) for a, b in s.segments) for s, o in moved),
                summary_positions=tuple(
                    tuple(p + o for p in s.summary_positions) for s, o in moved
                ),
                query_positions=torch.tensor(
                    [s.query_position + o for s, o in moved], dtype=torch.long, device=HOST
                ),
                answer_segments=torch.tensor(
                    [s.answer_segment for s in chunk], dtype=torch.long, device=HOST
                ),
                padding_side=padding_side,
            )


@dataclass(frozen=True)
class _Spec:
    prompt: str
    segment_chars: list[tuple[int, int]]
    answer_segment: int
    choices: list[str]
    answer_index: int
    info: dict[str, Any]


def _check_spec(i: int, spec: _Spec) -> None:
    n = len(spec.prompt)
    prev = 0
    if not spec.segment_chars:
        raise TaskError(f"sample {i}: no segments given; expected at least one (start, end).")
    for j, (s, e) in enumerate(spec.segment_chars):
        if not (prev <= s < e <= n):
            raise TaskError(
                f"sample {i}: segment {j} has character range ({s}, {e}); expected non-empty, "
                f"ordered, non-overlapping ranges inside the prompt (length {n})."
            )
        prev = e
    if not 0 <= spec.answer_segment < len(spec.segment_chars):
        raise TaskError(
            f"sample {i}: answer_segment={spec.answer_segment} but there are "
            f"{len(spec.segment_chars)} segments; expected 0 <= answer_segment < "
            f"{len(spec.segment_chars)}."
        )
    if len(spec.choices) < 1 or any(not isinstance(c, str) or not c for c in spec.choices):
        raise TaskError(f"sample {i}: choices={spec.choices!r}; expected non-empty strings.")
    if len(set(spec.choices)) != len(spec.choices):
        dup = sorted({c for c in spec.choices if spec.choices.count(c) > 1})
        raise TaskError(
            f"sample {i}: choices {spec.choices!r} repeat {dup!r}; expected distinct "
            "continuations (a repeated choice can never be told apart from the answer)."
        )
    if not 0 <= spec.answer_index < len(spec.choices):
        raise TaskError(
            f"sample {i}: answer_index={spec.answer_index} but there are {len(spec.choices)} "
            f"choices; expected 0 <= answer_index < {len(spec.choices)}."
        )


def sample_from_encoding(
    i: int,
    spec: _Spec,
    enc: Encoding,
    conts: Sequence[list[int] | None],
    tokenizer: Any,
    *,
    boundary: Literal["error", "split"] = "error",
) -> Sample:
    """Assemble a :class:`Sample` from the prompt's encoding and its choices' continuations.

    A choice is normally the tokens that ``prompt + choice`` adds after the prompt's own tokens
    (``conts``, from :func:`~gna_lens.tasks._tokens.continuations`).
    When the tokenizer merges the prompt's last characters with the choice (so the prompt's
    tokens are not a prefix), ``boundary="error"`` refuses and ``boundary="split"`` uses the
    choice tokenized on its own, listing such choices in ``info["split_choices"]``.
    """
    segments = []
    for j, (s, e) in enumerate(spec.segment_chars):
        a, b = enc.tokens_over(s, e)
        if b <= a:  # pragma: no cover - a non-empty character range always has a token
            raise TaskError(f"sample {i}: segment {j} ({s}, {e}) maps to no token.")
        segments.append((a, b))
    choice_ids = []
    split: list[int] = []
    for j, (c, ids) in enumerate(zip(spec.choices, conts, strict=True)):
        if not ids and boundary == "split":
            ids = encode(tokenizer, [c], add_special_tokens=False)[0].ids
            split.append(j)
        if not ids:
            raise TaskError(
                f"sample {i}: tokenizer {tokenizer_name(tokenizer)} does not keep the prompt's "
                f"tokens when the choice {c!r} is appended (the prompt ends with "
                f"{spec.prompt[-20:]!r}; a token merges across the boundary), so the choice "
                "cannot be scored as the continuation the tokenizer would produce. Fix: another "
                "template or tokenizer."
            )
        choice_ids.append(ids)
    info = dict(spec.info)
    if boundary == "split":
        info["split_choices"] = split
    return Sample(
        prompt=spec.prompt,
        input_ids=list(enc.ids),
        segments=segments,
        segment_chars=[(a, b) for a, b in spec.segment_chars],
        summary_positions=[b - 1 for _, b in segments],
        query_position=len(enc.ids) - 1,
        answer_segment=spec.answer_segment,
        choices=list(spec.choices),
        choice_ids=choice_ids,
        answer_index=spec.answer_index,
        info=info,
    )


def build_samples(
    tokenizer: Any,
    specs: Sequence[_Spec],
    *,
    add_special_tokens: bool = True,
    boundary: Literal["error", "split"] = "error",
) -> list[Sample]:
    """Tokenize prompts (and prompt + each choice) in two batched calls and build samples."""
    for i, spec in enumerate(specs):
        _check_spec(i, spec)
    out: list[Sample] = []
    for start in range(0, len(specs), _CHUNK):  # bounded memory: encodings of long prompts are big
        chunk = specs[start : start + _CHUNK]
        encs = encode(tokenizer, [s.prompt for s in chunk], add_special_tokens=add_special_tokens)
        conts = continuations(
            tokenizer, encs, [s.choices for s in chunk], add_special_tokens=add_special_tokens
        )
        for i, (spec, enc, cs) in enumerate(zip(chunk, encs, conts, strict=True)):
            out.append(sample_from_encoding(start + i, spec, enc, cs, tokenizer, boundary=boundary))
    return out


def build_sample(
    tokenizer: Any,
    prompt: str,
    segment_chars: Sequence[tuple[int, int]],
    *,
    answer_segment: int,
    choices: Sequence[str],
    answer_index: int | None = None,
    info: Mapping[str, Any] | None = None,
    add_special_tokens: bool = True,
    boundary: Literal["error", "split"] = "error",
) -> Sample:
    """Build a :class:`Sample` for a custom task from character ranges.

    Args:
        tokenizer: A HF fast tokenizer (it must return character offsets).
        prompt: The prompt text.
        segment_chars: Half-open character ranges of the segments, in order.
        answer_segment: Index of the segment holding the answer.
        choices: Candidate continuations (text appended right after the prompt).
        answer_index: Index of the correct choice; defaults to ``answer_segment``.
        info: Metadata stored on the sample.
        add_special_tokens: Let the tokenizer add its special tokens (BOS).
        boundary: What to do with a choice the tokenizer merges with the prompt's last token:
            ``"error"`` refuses, ``"split"`` scores the choice's own tokens (listed in
            ``info["split_choices"]``).

    Returns:
        The sample, with token spans computed from the tokenizer's offsets.

    Raises:
        TaskError: On inconsistent ranges or indices, repeated choices, a choice that merges
            with the prompt's last token, or a tokenizer without offsets.

    Examples:
        >>> from gna_lens.tasks.toy_tokenizers import word_tokenizer
        >>> tok = word_tokenizer(["red", "blue", "pick"])
        >>> s = build_sample(tok, "red\\nblue\\npick", [(0, 4), (4, 9)],
        ...                  answer_segment=1, choices=[" red", " blue"])
        >>> s.segments, s.summary_positions, s.query_position, s.answer_ids == s.choice_ids[1]
        ([(0, 2), (2, 4)], [1, 3], 4, True)
    """
    spec = _Spec(
        prompt=prompt,
        segment_chars=[(int(a), int(b)) for a, b in segment_chars],
        answer_segment=answer_segment,
        choices=list(choices),
        answer_index=answer_segment if answer_index is None else answer_index,
        info=dict(info or {}),
    )
    return build_samples(
        tokenizer, [spec], add_special_tokens=add_special_tokens, boundary=boundary
    )[0]
