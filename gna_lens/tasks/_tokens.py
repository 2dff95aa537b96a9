"""Tokenization with character offsets: the one place that turns text ranges into token ranges.

Every task renders its prompt as text while recording the character range of each segment, then
asks the tokenizer for each token's character offsets and maps ranges through them. This is what
makes spans right for any HF fast tokenizer: BPE whose tokens merge a ``\\n`` with neighbouring
characters, byte-level BPE (with or without trimmed offsets), SentencePiece-style metaspace, with or
without a BOS token.
"""

import bisect
import string
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from gna_lens.errors import TaskError

__all__ = ["Encoding", "encode", "render", "tokenizer_name"]


def tokenizer_name(tokenizer: Any) -> str:
    """A short human-readable name of a tokenizer, for error messages."""
    name = getattr(tokenizer, "name_or_path", "") or ""
    return f"{type(tokenizer).__name__}({name!r})" if name else type(tokenizer).__name__


@dataclass(frozen=True)
class Encoding:
    """One tokenized text with the character range each token covers.

    Attributes:
        text: The text that was tokenized.
        ids: Token ids, with the tokenizer's leading special tokens (e.g. BOS) and without
            trailing ones (e.g. an EOS some tokenizers append), so the last id is the last text
            token.
        offsets: The tokenizer's character offsets, as it returned them.
        special: The tokenizer's special-tokens mask.
    """

    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]
    special: list[int]

    @cached_property
    def covers(self) -> list[tuple[int, int]]:
        """For each token, the half-open character range ``(start, end)`` of ``text`` it stands for.

        Special tokens added by the tokenizer cover an empty range. Whitespace that a tokenizer
        trims from its offsets (byte-level BPE with ``trim_offsets=True``) is given to the token
        that follows it, which is the token that actually carries it.
        """
        return _covers(self.offsets, self.special)

    @cached_property
    def _ends(self) -> list[int]:
        return [e for _, e in self.covers]

    @cached_property
    def _starts(self) -> list[int]:
        return [s for s, _ in self.covers]

    def tokens_over(self, start: int, end: int) -> tuple[int, int]:
        """The half-open token range of the tokens overlapping characters ``[start, end)``.

        Tokens straddling a boundary are included, so decoding the range gives back the
        characters plus only what those boundary tokens carry. Returns ``(i, i)`` when no token
        overlaps (an empty range of characters).
        """
        first = bisect.bisect_right(self._ends, start)
        last = bisect.bisect_left(self._starts, end)
        # Skip zero-width tokens (added specials) at the edges of the range.
        while first < last and self.covers[first][0] == self.covers[first][1]:
            first += 1
        while last > first and self.covers[last - 1][0] == self.covers[last - 1][1]:
            last -= 1
        return (first, max(first, last))

    def n_tokens_over(self, start: int, end: int) -> int:
        """How many tokens overlap characters ``[start, end)``."""
        first, last = self.tokens_over(start, end)
        return last - first

    def continuation(self, prompt: "Encoding") -> list[int] | None:
        """The ids this encoding (of ``prompt.text + continuation``) adds after ``prompt``.

        Returns ``None`` when the prompt's own tokens are not a prefix of this encoding, i.e.
        when appending the continuation re-tokenizes the end of the prompt (a token straddling
        the boundary, or a different split of the prompt's last characters).
        """
        n = len(prompt.text)
        if not self.text.startswith(prompt.text):
            return None
        k = len(prompt.ids)
        if self.ids[:k] != prompt.ids:
            return None
        if k and self.offsets[k - 1][1] > n:
            return None
        if any(s < n for s, e in self.offsets[k:] if e > s):
            return None
        return list(self.ids[k:])


def _covers(offsets: Sequence[Sequence[int]], special: Sequence[int]) -> list[tuple[int, int]]:
    covers: list[tuple[int, int]] = []
    prev_end = 0
    for (s, e), sp in zip(offsets, special, strict=True):
        s, e = int(s), int(e)
        if sp and s == e:  # added special token (BOS, EOS, ...): covers nothing
            covers.append((prev_end, prev_end))
            continue
        start = prev_end if s >= prev_end else s
        end = max(e, start)
        covers.append((start, end))
        prev_end = max(prev_end, end)
    return covers


def encode(
    tokenizer: Any, texts: Sequence[str], *, add_special_tokens: bool = True
) -> list[Encoding]:
    """Tokenize texts and return each one's ids with their character covers.

    Args:
        tokenizer: A HF fast tokenizer (``transformers.PreTrainedTokenizerFast`` or any
            ``TokenizersBackend``), i.e. one that returns offset mappings.
        texts: The texts to tokenize (batched in one call).
        add_special_tokens: Passed to the tokenizer (adds BOS where the tokenizer does).

    Returns:
        One :class:`Encoding` per text.

    Raises:
        TaskError: If the tokenizer cannot return character offsets.
    """
    texts = list(texts)
    if not texts:
        return []
    try:
        out = tokenizer(
            texts,
            add_special_tokens=add_special_tokens,
            return_offsets_mapping=True,
            return_special_tokens_mask=True,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        offsets = out["offset_mapping"]
        special = out["special_tokens_mask"]
        ids = out["input_ids"]
    except (NotImplementedError, TypeError, ValueError, KeyError, AttributeError) as exc:
        raise TaskError(
            f"tokenizer {tokenizer_name(tokenizer)} gave no character offsets "
            f"(calling it with return_offsets_mapping=True failed: {type(exc).__name__}: {exc}). "
            "gna_lens.tasks needs a fast (Rust-backed) Hugging Face tokenizer to locate segment, "
            "summary and query tokens. Fix: load it with AutoTokenizer.from_pretrained(..., "
            "use_fast=True), or wrap a `tokenizers.Tokenizer` in "
            "transformers.PreTrainedTokenizerFast(tokenizer_object=...)."
        ) from exc
    encodings = []
    for text, ids_i, off_i, sp_i in zip(texts, ids, offsets, special, strict=True):
        n = len(ids_i)
        # Drop trailing added specials (an EOS appended by the post-processor): the last prompt
        # token must be the last text token, where the next-token prediction is read.
        while n > 1 and sp_i[n - 1] and off_i[n - 1][0] == off_i[n - 1][1]:
            n -= 1
        encodings.append(Encoding(text=text, ids=ids_i[:n], offsets=off_i[:n], special=sp_i[:n]))
    return encodings


def render(template: str, what: str, **fields: str) -> tuple[str, dict[str, list[tuple[int, int]]]]:
    """Fill a ``str.format``-style template, recording where each field landed.

    Args:
        template: The template, with ``{name}`` placeholders (``{{``/``}}`` for literal braces).
        what: What the template is, for error messages (e.g. ``"KVTemplate.line"``).
        **fields: The values of the placeholders.

    Returns:
        The text and, for each field name, the character ranges of its occurrences.

    Raises:
        TaskError: On a placeholder that is not among ``fields`` or uses a format spec.
    """
    parts: list[str] = []
    where: dict[str, list[tuple[int, int]]] = {k: [] for k in fields}
    pos = 0
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise TaskError(f"{what}={template!r} is not a valid format string ({exc}).") from exc
    for literal, name, spec, conv in parsed:
        parts.append(literal)
        pos += len(literal)
        if name is None:
            continue
        if name not in fields or spec or conv:
            raise TaskError(
                f"{what}={template!r} has placeholder {{{name}{'!' + conv if conv else ''}"
                f"{':' + spec if spec else ''}}}; expected only "
                f"{', '.join('{' + k + '}' for k in fields)} (write {{{{ and }}}} for literal "
                "braces)."
            )
        value = fields[name]
        where[name].append((pos, pos + len(value)))
        parts.append(value)
        pos += len(value)
    return "".join(parts), where


_TAIL_CHARS = 64


def _tail_cut(enc: Encoding) -> tuple[int, int] | None:
    """A token boundary ``(token index, char)`` about ``_TAIL_CHARS`` before the end, or None."""
    covers = enc.covers
    target = len(enc.text) - _TAIL_CHARS
    j = bisect.bisect_left(enc._starts, max(target, 1))
    while j < len(covers) and covers[j][0] == covers[j][1]:
        j += 1
    if j >= len(covers) or covers[j][0] <= 0 or j == 0 or covers[j - 1][1] > covers[j][0]:
        return None
    return j, covers[j][0]


def continuations(
    tokenizer: Any,
    prompts: Sequence[Encoding],
    choices: Sequence[Sequence[str]],
    *,
    add_special_tokens: bool = True,
) -> list[list[list[int] | None]]:
    """For each prompt and each of its choices, the ids the choice adds after the prompt.

    ``None`` where appending the choice re-tokenizes the prompt's end (see
    :meth:`Encoding.continuation`). Long prompts are not re-encoded whole for every choice:
    the prompt's last ~64 characters, cut at a token boundary, are encoded alone; where they
    reproduce the prompt's last tokens exactly (tokenization is local there), the choices are
    appended to that tail only. Elsewhere the whole ``prompt + choice`` is encoded.
    """
    cuts = {i: c for i, c in enumerate(map(_tail_cut, prompts)) if c}
    tails = [prompts[i].text[char:] for i, (_, char) in cuts.items()]
    local: list[Encoding | None] = [None] * len(prompts)
    tail_encs = encode(tokenizer, tails, add_special_tokens=False)
    for (i, (j, _)), te in zip(cuts.items(), tail_encs, strict=True):
        if te.ids == prompts[i].ids[j:]:
            local[i] = te
    rows = list(zip(prompts, local, choices, strict=True))
    # Choices after a reproduced tail are encoded with it, without specials; others after the
    # whole prompt.
    tail_texts = [lp.text + ch for _, lp, cs in rows if lp is not None for ch in cs]
    full_texts = [p.text + ch for p, lp, cs in rows if lp is None for ch in cs]
    tail_out = iter(encode(tokenizer, tail_texts, add_special_tokens=False))
    full_out = iter(encode(tokenizer, full_texts, add_special_tokens=add_special_tokens))
    out: list[list[list[int] | None]] = []
    for p, lp, cs in rows:
        ref, src = (p, full_out) if lp is None else (lp, tail_out)
        out.append([next(src).continuation(ref) for _ in cs])
    return out
