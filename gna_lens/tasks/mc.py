"""Multiple-choice prompts in letter (MMLU) and cloze (classic) formats.

Both formats show the same prompt::

    The following are multiple choice questions (with answers) about astronomy.

    What is the closest star to Earth?
    A. Sirius
    B. The Sun
    C. Proxima Centauri
    D. Vega
    Answer:

and differ only in what is scored after ``Answer:``: the letter (``" A"`` .. ``" D"``; needs
retrieval through G&A) or the option's text (``" The Sun"``; needs only knowledge). Segments are
the option lines, each one's summary token is its last token (the one holding its ``\\n``).
"""

import random
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Literal

from gna_lens.errors import TaskError
from gna_lens.tasks.core import Task, _Spec, build_samples, default_pad_token_id
from gna_lens.tasks.records import LETTERS, MCRecord, coerce_records

__all__ = ["format_question", "multiple_choice"]

_MMLU_HEADER = "The following are multiple choice questions (with answers) about {}.\n\n"


def format_question(question: str, options: Iterable[str]) -> tuple[str, list[tuple[int, int]]]:
    """The question block (question, lettered option lines, ``Answer:``) and its option lines.

    Returns:
        The text and the character range of each option line (its ``\\n`` included).

    Examples:
        >>> text, lines = format_question("2 + 2 =", ["3", "4"])
        >>> print(text)
        2 + 2 =
        A. 3
        B. 4
        Answer:
        >>> [text[a:b] for a, b in lines]
        ['A. 3\\n', 'B. 4\\n']
    """
    parts = [question.rstrip("\n") + "\n"]
    pos = len(parts[0])
    lines = []
    for letter, opt in zip(LETTERS, options, strict=False):
        line = f"{letter}. {opt}\n"
        lines.append((pos, pos + len(line)))
        parts.append(line)
        pos += len(line)
    parts.append("Answer:")
    return "".join(parts), lines


def _continuation(fmt: str, options: tuple[str, ...], i: int) -> str:
    return f" {LETTERS[i]}" if fmt == "letter" else f" {options[i].strip()}"


def _permuted(r: MCRecord, rng: random.Random, permute: bool) -> MCRecord:
    if not permute:
        return r
    order = list(range(len(r.options)))
    rng.shuffle(order)
    return MCRecord(
        question=r.question,
        options=tuple(r.options[j] for j in order),
        answer=order.index(r.answer),
        subject=r.subject,
        id=r.id,
    )


def multiple_choice(
    records: Iterable[Any],
    tokenizer: Any,
    format: Literal["letter", "cloze"] = "letter",
    seed: int = 0,
    *,
    permute: bool = False,
    n_shots: int = 0,
    length_normalize: bool | Literal["tokens", "chars"] = False,
    header: str | None = None,
    duplicate_options: Literal["error", "drop"] = "error",
    add_special_tokens: bool = True,
    max_length: int | None = None,
) -> Task:
    """Multiple-choice prompts with token-level spans, in letter or cloze format.

    Args:
        records: Questions: :class:`MCRecord` objects, mappings with ``question``,
            ``choices``/``options`` and ``answer`` fields, or ``(question, options, answer)``
            tuples (see :func:`load_records`, :func:`load_mmlu`).
        tokenizer: A HF fast tokenizer (returns character offsets).
        format: ``"letter"`` scores ``" A"``, ``" B"``, ...; ``"cloze"`` scores ``" " + option``.
            The prompt is the same in both.
        seed: Seed for option permutation and the choice of few-shot demonstrations.
        permute: Shuffle each question's options (the answer index follows).
        n_shots: Number of solved demonstrations before each question, drawn from other
            questions of the same subject (never the scored one, nor one with the same text),
            written with their answer in the task's format.
        length_normalize: How multi-token (cloze) choices are compared: ``False`` sums the
            log-probs, ``"tokens"``/``True`` averages them per token, ``"chars"`` divides by the
            length in characters.
        header: Text before everything; ``None`` gives MMLU's "The following are multiple choice
            questions (with answers) about {subject}.\\n\\n" when the record has a subject, else
            nothing.
        duplicate_options: ``"error"`` refuses a question with two identical options (it cannot
            be scored in cloze format); ``"drop"`` skips such questions.
        add_special_tokens: Let the tokenizer add its BOS.
        max_length: If given, refuse prompts longer than this many tokens.

    Returns:
        A :class:`Task` scored by ``"choices"``; samples carry ``info`` ``question``,
        ``options``, ``subject``, ``id``, ``record_index``, ``format``, ``demos`` (the ids of the
        demonstrations) and ``split_choices``: the choices the tokenizer would merge with the
        prompt's last token (e.g. ``":"`` + ``" 50"`` into ``": 50"``), which are scored as the
        choice's own tokens after the prompt's tokens (a valid but not the canonical
        tokenization of the text).

    Raises:
        TaskError: On duplicate options, an answer out of range, too few questions of a subject
            for ``n_shots``, a prompt over ``max_length``, or a tokenizer without offsets.

    Examples:
        >>> from gna_lens.tasks.toy_tokenizers import word_tokenizer
        >>> rec = [("What is 2 + 2?", ["3", "4", "5", "6"], 1)]
        >>> tok = word_tokenizer(["What is 2 + 2? Answer:"])
        >>> letter = multiple_choice(rec, tok, format="letter")
        >>> cloze = multiple_choice(rec, tok, format="cloze")
        >>> letter[0].prompt == cloze[0].prompt, letter[0].choices, cloze[0].choices
        (True, [' A', ' B', ' C', ' D'], [' 3', ' 4', ' 5', ' 6'])
        >>> s = letter[0]
        >>> [tok.decode(s.input_ids[a:b]) for a, b in s.segments][:2]
        ['A. 3\\n', 'B. 4\\n']
    """
    if format not in ("letter", "cloze"):
        raise TaskError(f"format={format!r}; expected 'letter' (score ' A'..) or 'cloze'.")
    if duplicate_options not in ("error", "drop"):
        raise TaskError(f"duplicate_options={duplicate_options!r}; expected 'error' or 'drop'.")
    if not isinstance(n_shots, int) or n_shots < 0:
        raise TaskError(f"n_shots={n_shots!r}; expected a non-negative int.")
    recs = coerce_records(records)
    kept: list[tuple[int, MCRecord]] = []
    for i, r in enumerate(recs):
        stripped = [o.strip() for o in r.options]
        if len(set(stripped)) != len(stripped):
            if duplicate_options == "drop":
                continue
            dup = sorted({o for o in stripped if stripped.count(o) > 1})
            raise TaskError(
                f"record {i} (question {r.question[:60]!r}) has options {list(r.options)!r} that "
                f"repeat {dup!r}; expected distinct options. Fix: correct the record, or pass "
                "duplicate_options='drop' to skip such questions."
            )
        kept.append((i, r))

    by_subject: dict[str | None, list[int]] = defaultdict(list)
    for k, (_, r) in enumerate(kept):
        by_subject[r.subject].append(k)

    rng = random.Random(seed)
    specs: list[_Spec] = []
    for k, (i, r0) in enumerate(kept):
        r = _permuted(r0, rng, permute)
        demos_text = ""
        demo_ids: list[str | None] = []
        if n_shots:
            pool = [
                j for j in by_subject[r.subject] if j != k and kept[j][1].question != r.question
            ]
            if len(pool) < n_shots:
                raise TaskError(
                    f"record {i}: n_shots={n_shots} but subject {r.subject!r} has only "
                    f"{len(pool)} other questions; expected at least {n_shots}. Fix: lower "
                    "n_shots or pass more questions of that subject."
                )
            for j in rng.sample(pool, n_shots):
                d = _permuted(kept[j][1], rng, permute)
                text, _ = format_question(d.question, d.options)
                demos_text += text + _continuation(format, d.options, d.answer) + "\n\n"
                demo_ids.append(d.id if d.id is not None else f"record {kept[j][0]}")
        head = header
        if head is None:
            about = (r.subject or "").replace("_", " ")
            head = _MMLU_HEADER.format(about) if about else ""
        block, lines = format_question(r.question, r.options)
        start = len(head) + len(demos_text)
        specs.append(
            _Spec(
                prompt=head + demos_text + block,
                segment_chars=[(a + start, b + start) for a, b in lines],
                answer_segment=r.answer,
                choices=[_continuation(format, r.options, j) for j in range(len(r.options))],
                answer_index=r.answer,
                info={
                    "question": r.question,
                    "options": list(r.options),
                    "subject": r.subject or "",
                    "id": r.id or "",
                    "record_index": i,
                    "format": format,
                    "demos": [str(d) for d in demo_ids],
                },
            )
        )
    samples = build_samples(
        tokenizer, specs, add_special_tokens=add_special_tokens, boundary="split"
    )
    if max_length is not None:
        for k, s in enumerate(samples):
            if s.n_tokens > max_length:
                raise TaskError(
                    f"sample {k} (record {s.info['record_index']}) has {s.n_tokens} tokens but "
                    f"max_length={max_length}. Fix: fewer shots (n_shots={n_shots}), drop long "
                    "questions, or a larger max_length."
                )
    return Task(
        samples=tuple(samples),
        name=f"multiple_choice(format={format}, n_shots={n_shots}, permute={permute})",
        scoring="choices",
        length_normalize=length_normalize,
        pad_token_id=default_pad_token_id(tokenizer),
        info={
            "task": "multiple_choice",
            "format": format,
            "n_shots": n_shots,
            "permute": permute,
            "seed": seed,
            "n_records": len(recs),
            "n_dropped": len(recs) - len(kept),
        },
        tokenizer=tokenizer,
    )
