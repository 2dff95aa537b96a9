"""Tiny tokenizers built offline, for the examples and tests of :mod:`gna_lens.tasks`.

They cover the ways a tokenizer can cut a prompt that matter for spans: whole words, byte-level BPE
(GPT-2 / Llama-3 style, with trimmed offsets), a BPE that merges ``\\n`` with the characters around
it (so tokens like ``":50\\n"`` exist and the summary token is not a bare newline), and a
SentencePiece-style metaspace BPE (``"▁word"`` tokens, newlines inside tokens).
"""

import re
import string
from collections.abc import Iterable
from typing import Any

__all__ = [
    "byte_level_bpe_tokenizer",
    "metaspace_bpe_tokenizer",
    "newline_merging_bpe_tokenizer",
    "word_tokenizer",
]

_WORD_RE = r" ?[A-Za-z0-9_]+| ?[^\sA-Za-z0-9_]|\n| "
_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def wrap_fast(tok: Any, bos: bool) -> Any:
    """A ``tokenizers.Tokenizer`` as a transformers fast tokenizer with this module's specials
    (``<unk> <s> </s> <pad>``); ``bos``: every encoding starts with ``<s>``."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if bos:
        template = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
        tok.post_processor = (
            processors.Sequence([tok.post_processor, template])
            if tok.post_processor is not None
            else template
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def _train_bpe(
    tok: Any, texts: Iterable[str], vocab_size: int, bos: bool, alphabet: Any = None
) -> Any:
    """Train the BPE ``tok`` on ``texts`` (initial alphabet: ``alphabet``, else the texts'
    characters and the digits) and wrap it with :func:`wrap_fast`."""
    from tokenizers import trainers

    texts = list(texts)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIALS,
        initial_alphabet=alphabet or sorted(set("".join(texts)) | set("0123456789")),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return wrap_fast(tok, bos)


def word_tokenizer(texts: Iterable[str], *, bos: bool = False) -> Any:
    """A word-level tokenizer whose vocabulary is every word (with its leading space) in ``texts``.

    Words and single punctuation marks (each with or without one leading space), ``\\n`` and bare
    spaces are tokens; anything else is ``<unk>``. The numbers 0-99, capital letters and ASCII punctuation are
    always in the vocabulary.

    Examples:
        >>> tok = word_tokenizer(["Hello world"])
        >>> tok.convert_ids_to_tokens(tok("Hello world\\n")["input_ids"])
        ['Hello', ' world', '\\n']
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {s: i for i, s in enumerate(_SPECIALS)}
    pieces = ["\n", " ", *string.ascii_uppercase, *string.punctuation]
    pieces += [str(n) for n in range(100)]
    for text in texts:
        pieces += [p.lstrip(" ") for p in re.findall(_WORD_RE, text)]
    for p in pieces:
        vocab.setdefault(p, len(vocab))
        vocab.setdefault(" " + p, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_WORD_RE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return wrap_fast(tok, bos)


def byte_level_bpe_tokenizer(
    texts: Iterable[str], *, vocab_size: int = 600, bos: bool = False
) -> Any:
    """A byte-level BPE (GPT-2 style pre-tokenization, offsets trimmed of spaces) trained on ``texts``.

    Examples:
        >>> tok = byte_level_bpe_tokenizer(["the cat sat on the mat\\n"] * 20, vocab_size=300)
        >>> tok.decode(tok("the mat\\n")["input_ids"])
        'the mat\\n'
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    return _train_bpe(tok, texts, vocab_size, bos, pre_tokenizers.ByteLevel.alphabet())


def newline_merging_bpe_tokenizer(
    texts: Iterable[str], *, vocab_size: int = 600, bos: bool = False
) -> Any:
    """A character BPE that isolates words, so the text between them merges across ``\\n``.

    Runs of letters (with one optional leading space) are pre-tokens; everything between them
    (punctuation, digits, spaces, newlines) forms one pre-token, so BPE learns tokens like
    ``":50\\n"`` where a dictionary line's separator, value and newline are one token.

    Examples:
        >>> tok = newline_merging_bpe_tokenizer(["cat:50\\ndog:51\\n"] * 20, vocab_size=60)
        >>> tok.convert_ids_to_tokens(tok("dog:50\\ncat:51\\n")["input_ids"])
        ['dog', ':50\\n', 'cat', ':51\\n']
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(" ?[A-Za-z]+"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return _train_bpe(tok, texts, vocab_size, bos)


def metaspace_bpe_tokenizer(
    texts: Iterable[str], *, vocab_size: int = 1200, bos: bool = False
) -> Any:
    """A SentencePiece-style BPE: spaces become ``"▁"``, words carry it, ``\\n`` is not a boundary.

    Examples:
        >>> tok = metaspace_bpe_tokenizer(["the cat sat\\non the mat\\n"] * 20, vocab_size=60)
        >>> tok.convert_ids_to_tokens(tok("the cat")["input_ids"])
        ['▁the', '▁cat']
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return _train_bpe(tok, texts, vocab_size, bos)
