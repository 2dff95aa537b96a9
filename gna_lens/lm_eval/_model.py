"""``GnaLM``: an lm-evaluation-harness model backed by a gna_lens model, with heads removed.

Registered with lm-eval's model registry as ``"gna_lens"`` when :mod:`gna_lens.lm_eval` is
imported. Every forward pass runs inside context managers that attach the ablation and mask
hooks and remove them on exit, even when the model raises: between calls the model has exactly
the hooks it had before.
"""

import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, fields
from itertools import groupby
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from torch import Tensor
from tqdm import tqdm

from gna_lens.device import HOST, resolve_device
from gna_lens.errors import ConfigError, InterventionError
from gna_lens.heads import Head, HookedModel, policy_of
from gna_lens.render.markdown import heads_label

__all__ = ["DEFAULT_MAX_LENGTH", "GnaLM", "Intervention", "parse_heads", "register"]

#: Context length used when the model declares none (SSMs), as lm-eval's ``hf`` backend does.
DEFAULT_MAX_LENGTH = 2048
_HEAD = re.compile(r"^\s*[Ll]?(\d+)\s*[Hh.:/]\s*(\d+)\s*$")
_MODES = ("zero", "mean")
_MASKS = ("gather", "aggregate", "gather_complement", "aggregate_complement")
_SEGMENTS = {
    # Lettered option lines ("A. Paris\n"): MMLU / ARC-chat style prompts.
    "options": re.compile(r"^[A-Z][.)] .*$"),
    # Key-value lines ("scallops:84\n", "apple: red\n").
    "kv": re.compile(r"^[^\s:]+ ?: ?\S+$"),
    # Any non-empty lines (explicit only: a header line would become a segment too).
    "lines": re.compile(r"^.+$"),
}


def parse_heads(spec: Any, what: str = "remove") -> tuple[Head, ...]:
    """Heads from ``"L16H0;L17H2"`` (also ``"16.0 17.2"``, ``"16:0+17:2"``) or ``[(16, 0), ...]``.

    Args:
        spec: A string of heads separated by ``;``, ``+`` or spaces (lm-eval splits
            ``model_args`` at commas, so commas cannot separate heads), or a sequence of
            ``(layer, head)`` pairs; ``None`` or ``""`` for none.
        what: The argument's name, for error messages.

    Returns:
        The heads, in the order given, duplicates dropped.

    Raises:
        ConfigError: For a head that cannot be read.

    Examples:
        >>> parse_heads("L16H0;L17H2")
        ((16, 0), (17, 2))
        >>> parse_heads([(3, 1), [0, 2]])
        ((3, 1), (0, 2))
    """
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return ()
    out: list[Head] = []
    if isinstance(spec, str):
        for part in re.split(r"[;+\s]+", spec.strip()):
            m = _HEAD.match(part)
            if m is None:
                raise ConfigError(
                    f"{what}={spec!r}: cannot read head {part!r}; expected heads like "
                    "'L16H0;L17H2' (layer 16 head 0, layer 17 head 2), separated by ';', '+' "
                    "or spaces."
                )
            out.append((int(m.group(1)), int(m.group(2))))
    else:
        for h in spec:
            try:
                layer, head = (int(x) for x in h)
            except (TypeError, ValueError) as err:
                raise ConfigError(
                    f"{what}: cannot read head {h!r}; expected (layer, head) pairs."
                ) from err
            out.append((layer, head))
    return tuple(dict.fromkeys(out))


def format_heads(heads: Sequence[Head]) -> str:
    """``"L16H0;L17H2"`` (the form :func:`parse_heads` reads)."""
    return heads_label(heads, ";")


@dataclass(frozen=True)
class Intervention:
    """What is done to the model during an lm-eval run.

    Attributes:
        heads: Heads ablated (``(layer, head)``), ``()`` for none.
        mode: ``"zero"`` or ``"mean"``: the head's mean output over 8 windows of 64 tokens of
            the shipped prose, taken where it is ablated (every position but BOS for
            ``positions="all"``, the windows' last tokens for ``"last"``; see
            :func:`gna_lens.interventions.head_ablation_hooks`).
        positions: ``"all"`` (every position) or ``"last"`` (the last context token of each
            request: the position that predicts the continuation's first token; in generation,
            the last position of every step).
        include_bos: Mean ablation: average over and edit the BOS position too.
        mask: ``None`` or a G&A pattern mask applied to ``mask_heads``: ``"gather"`` (each
            segment's summary token attends only within its segment), ``"aggregate"`` (the last
            context token attends only to the summary tokens), or their ``"_complement"``.
        mask_heads: Heads whose patterns are masked.
        mask_mode: ``"post"`` (after the softmax, not renormalized) or ``"pre"``.
        segments: How segments are found in each request's context: ``"options"`` (the last run
            of lettered option lines ``"A. ..."``), ``"kv"`` (the last run of ``key: value``
            lines), ``"lines"`` (the last run of non-empty lines before the query line) or
            ``"auto"`` (options, else kv). Each segment is a line with its ``\n``; its summary
            token is the line's last token.
    """

    heads: tuple[Head, ...] = ()
    mode: str = "zero"
    positions: str = "all"
    include_bos: bool = False
    mask: str | None = None
    mask_heads: tuple[Head, ...] = ()
    mask_mode: str = "post"
    segments: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ConfigError(
                f"mode={self.mode!r}; expected one of {_MODES} (resample ablation needs paired "
                "prompts, which lm-eval requests do not have)."
            )
        if self.positions not in ("all", "last"):
            raise ConfigError(
                f"positions={self.positions!r}; expected 'all' or 'last' (the last context "
                "token of each request)."
            )
        if self.mask is not None and self.mask not in _MASKS:
            raise ConfigError(f"mask={self.mask!r}; expected one of {_MASKS} or none.")
        if (self.mask is None) != (not self.mask_heads):
            raise ConfigError(
                f"mask={self.mask!r} with mask_heads={format_heads(self.mask_heads)!r}; expected "
                "both (e.g. mask=aggregate,mask_heads=L17H2) or neither."
            )
        if self.mask_mode not in ("post", "pre"):
            raise ConfigError(f"mask_mode={self.mask_mode!r}; expected 'post' or 'pre'.")
        if self.segments not in ("auto", *_SEGMENTS):
            raise ConfigError(
                f"segments={self.segments!r}; expected 'auto', {' or '.join(map(repr, _SEGMENTS))}."
            )

    def describe(self) -> str:
        """One line, e.g. ``"zero ablation of L16H0;L17H2 at all positions"``."""
        parts = []
        if self.heads:
            parts.append(
                f"{self.mode} ablation of {format_heads(self.heads)} at "
                + ("all positions" if self.positions == "all" else "the last context token")
            )
        if self.mask:
            parts.append(
                f"{self.mask} mask ({self.mask_mode}-softmax) on {format_heads(self.mask_heads)}, "
                f"segments: {self.segments}"
            )
        return "; ".join(parts) or "none"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable fields."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out |= {n: [list(h) for h in out[n]] for n in ("heads", "mask_heads")}
        return out | {"description": self.describe()}


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name == "auto":
        return torch.float32
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ConfigError(f"dtype={value!r}; expected float32, bfloat16 or float16.")
    return dt


def _device(device: str | None) -> str:
    """The device to load on, as lm-eval's ``hf`` backend picks it: the one asked for
    (:func:`~gna_lens.device.resolve_device`: none means CUDA where there is one, else the CPU),
    except that a CUDA device on a machine without one (lm-eval's CLI default is ``cuda:0``)
    means the CPU."""
    if device and str(device).startswith("cuda") and not torch.cuda.is_available():
        logging.getLogger(__name__).info("device=%r: no CUDA device here, using the CPU", device)
        return str(HOST)
    return str(resolve_device(device))


def _checkpoint_adds_bos(tokenizer: Any) -> bool | None:
    """Whether the checkpoint's own tokenizer adds BOS, where TransformerLens changed that.

    TransformerLens's bridge reloads every tokenizer with ``add_bos_token=True``; lm-eval's ``hf``
    backend uses the checkpoint's default (GPT-2-style tokenizers add none). Returns ``None``
    when the tokenizer was not changed (or the original cannot be reloaded): use it as it is.
    """
    init = dict(getattr(tokenizer, "init_kwargs", {}) or {})
    if not init.get("add_bos_token") or tokenizer.bos_token_id is None:
        return None
    path = init.pop("name_or_path", None) or getattr(tokenizer, "name_or_path", None)
    init.pop("add_bos_token", None)
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        original = AutoTokenizer.from_pretrained(path, **init)
    except (OSError, ValueError, TypeError):
        return None
    ids = original.encode("a")
    return bool(ids) and ids[0] == original.bos_token_id


def _segment_chars(context: str, how: str) -> list[tuple[int, int]]:
    """Character ranges (each line with its ``\\n``) of the last run of segment lines."""
    lines = [(m.start(), m.end(), m.group()) for m in re.finditer(r"^.*$", context, re.M)]
    for kind in ["options", "kv"] if how == "auto" else [how]:
        # The last line is the query (it has no "\n"): it is never a segment.
        matched = groupby(lines[:-1], key=lambda x: bool(_SEGMENTS[kind].match(x[2])))
        runs = [run for run in (list(g) for match, g in matched if match) if len(run) >= 2]
        if runs:
            return [(start, end + 1) for start, end, _ in runs[-1]]
    return []


@dataclass
class _Row:
    """One input row: its tokens, where its context ends, its text (for masks)."""

    tokens: list[int]
    last_context: int
    context: str | None = None
    context_tokens: list[int] = field(default_factory=list)


class GnaLM(TemplateLM):
    """An lm-eval model (``--model gna_lens``) running a gna_lens model with heads removed.

    ``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` follow lm-eval's ``hf``
    backend (same tokenization, context truncation, rolling windows, stop sequences; greedy
    generation), so an unablated model gives the ``hf`` backend's numbers. Requests are batched
    (longest first; right padding for scoring, left padding for generation). Generation
    recomputes the whole sequence at each step (no KV cache), so that every step sees the same
    ablation.

    Args:
        pretrained: What :func:`gna_lens.load_model` loads: a hub name, a local folder, a
            ``.gguf`` file, ``"smollm2-135m"`` or a zoo name. Or pass ``model``.
        model: An already loaded TransformerBridge or HookedSSM (with ``tokenizer``).
        remove: Heads to ablate: ``"L16H0;L17H2"`` or ``[(16, 0), (17, 2)]``
            (:attr:`Intervention.heads`).
        mode, positions, include_bos, mask, mask_heads, mask_mode, segments: The
            :class:`Intervention`'s fields (``mask_heads`` read as ``remove``); the mask is built
            per request from the segments of its context.
        batch_size: Rows per forward pass (``"auto"`` means 8).
        dtype: Weights dtype when loading (``float32``, ``bfloat16``, ...).
        device: Device when loading (``cpu``, ``cuda``; as lm-eval's ``hf`` backend, a CUDA
            device on a machine without one means the CPU).
        max_length: Context length (default: the model's, else 2048).
        max_gen_toks: Default generation budget (lm-eval's 256).
        add_bos_token: Force the tokenizer to add (or not) its BOS (default: its own setting).
        max_batch_size: Accepted for lm-eval's CLI; unused.

    Raises:
        ConfigError: For unknown arguments, heads, modes or dtypes.

    Examples:
        >>> import tempfile
        >>> from gna_lens.lm_eval import GnaLM
        >>> from gna_lens.testing import tiny_checkpoint
        >>> lm = GnaLM(pretrained=str(tiny_checkpoint("mamba2", tempfile.mkdtemp())),
        ...            remove="L1H0;L1H3", batch_size=4)
        >>> lm.intervention.describe()
        'zero ablation of L1H0;L1H3 at all positions'
    """

    tokenizer: Any

    def __init__(
        self,
        pretrained: str | None = None,
        *,
        model: HookedModel | None = None,
        remove: Any = None,
        mode: str = "zero",
        positions: str = "all",
        include_bos: bool = False,
        mask: str | None = None,
        mask_heads: Any = None,
        mask_mode: str = "post",
        segments: str = "auto",
        batch_size: int | str | None = 8,
        dtype: Any = "float32",
        device: str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        max_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if kwargs:
            raise ConfigError(
                f"gna_lens lm-eval model: unknown argument(s) {sorted(kwargs)}; accepted: "
                "pretrained, remove, mode, positions, include_bos, mask, mask_heads, mask_mode, "
                "segments, batch_size, dtype, device, max_length, max_gen_toks, add_bos_token."
            )
        if (model is None) == (pretrained is None):
            raise ConfigError(
                "GnaLM: pass exactly one of pretrained=<name or folder> (model_args "
                "pretrained=...) and model=<a loaded gna_lens model>."
            )
        self.intervention = Intervention(
            heads=parse_heads(remove, "remove"),
            mode=mode,
            positions=str(positions),
            include_bos=bool(include_bos),
            mask=None if mask in (None, "", "none") else str(mask),
            mask_heads=parse_heads(mask_heads, "mask_heads"),
            mask_mode=mask_mode,
            segments=segments,
        )
        if model is None:
            from gna_lens.models import load_model

            model = load_model(str(pretrained), dtype=_dtype(dtype), device=_device(device))
        self._model = model
        self.tokenizer = getattr(model, "tokenizer", None)
        if self.tokenizer is None:
            raise ConfigError(
                "GnaLM: the model has no tokenizer (model.tokenizer is None); lm-eval requests "
                "are text. Load it with its tokenizer files, or set model.tokenizer."
            )
        #: Where the model runs: token ids, masks and ablation positions are made there.
        self._device = policy_of(model).device
        if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
            batch_size = 8
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r}; expected a positive int.")
        from gna_lens.tasks.evaluate import model_context_length

        self._max_length = int(max_length or model_context_length(model) or DEFAULT_MAX_LENGTH)
        self._max_gen_toks = int(max_gen_toks)
        #: ``None``: the tokenizer's own default (``hf`` backend); ``True`` / ``False``: forced.
        self.add_bos_token = add_bos_token
        #: How the BOS setting was decided, for the record.
        self.bos_rule = (
            "forced by add_bos_token" if add_bos_token is not None else "tokenizer default"
        )
        if add_bos_token is None:
            default = _checkpoint_adds_bos(self.tokenizer)
            if default is not None:
                self.add_bos_token = default
                self.bos_rule = (
                    f"the checkpoint tokenizer's default ({'adds' if default else 'no'} BOS), as "
                    "lm-eval's hf backend; TransformerLens's copy of the tokenizer always adds one"
                )
        self._static_hooks: list[Any] | None = None
        self._reference_tokens: Tensor | None = None
        self._check_heads()

    # ------------------------------------------------------------------ lm-eval properties
    @property
    def model(self) -> Any:
        """The gna_lens model (TransformerBridge or HookedSSM)."""
        return self._model

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.tokenizer.eos_token_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or "").replace("/", "__")

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of ``string`` exactly as lm-eval's ``hf`` backend encodes them."""
        special: dict[str, bool] = {}
        if add_special_tokens is not None:
            special["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            special["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and has_bos_prefix(
            string, self.tokenizer.decode(self.prefix_token_id)
        ):
            special["add_special_tokens"] = False
        ids = list(self.tokenizer.encode(string, **special))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens))

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records about the model: gna_lens's provenance and the intervention."""
        from gna_lens.models import provenance_of

        return {
            "gna_lens_provenance": provenance_of(self._model).to_dict(),
            "gna_lens_intervention": self.intervention.to_dict(),
            "gna_lens_bos": self.bos_rule,
        }

    # ------------------------------------------------------------------ interventions
    def _check_heads(self) -> None:
        """Refuse unknown heads now, not after the first batch."""
        from gna_lens.heads import head_view

        view, iv = head_view(self._model), self.intervention
        for heads, what in ((iv.heads, "remove"), (iv.mask_heads, "mask_heads")):
            if heads:
                view.check_heads(list(heads), what)

    def _reference(self) -> Any:
        """Mean ablation's reference: 8 windows of 64 tokens of the shipped prose."""
        if self.intervention.mode != "mean":
            return None
        if self._reference_tokens is None:
            from gna_lens.tasks import text_control

            control = text_control(self.tokenizer, n_sequences=8, seq_len=64, split="all")
            self._reference_tokens = control.tokens.to(self._device)
        return self._reference_tokens

    @torch.no_grad()
    def _ablation_hooks(self, positions: Any) -> list[Any]:
        from gna_lens.interventions import head_ablation_hooks

        iv = self.intervention
        return head_ablation_hooks(
            self._model, list(iv.heads), iv.mode, positions, self._reference(), iv.include_bos
        )

    @contextmanager
    def intervened(self, rows: Sequence[_Row], width: int, offsets: Sequence[int]) -> Iterator[Any]:
        """The model with this batch's ablation and mask hooks attached (removed on exit).

        Args:
            rows: The batch's rows.
            width: The padded width.
            offsets: Each row's left padding.
        """
        from gna_lens.interventions.hooks import hooked

        iv = self.intervention
        with ExitStack() as stack:
            if iv.heads:
                if iv.positions == "all":
                    if self._static_hooks is None:
                        self._static_hooks = self._ablation_hooks(None)
                    hooks = self._static_hooks
                else:
                    last = torch.tensor(
                        [r.last_context + o for r, o in zip(rows, offsets, strict=True)],
                        device=self._device,
                    )
                    hooks = self._ablation_hooks(last)
                stack.enter_context(hooked(self._model, hooks))
            if iv.mask:
                from gna_lens.interventions import mask_patterns

                masks = self._masks(rows, width, offsets)
                stack.enter_context(mask_patterns(self._model, masks, iv.mask_mode))  # type: ignore[arg-type]
            yield self._model

    def _masks(
        self, rows: Sequence[_Row], width: int, offsets: Sequence[int]
    ) -> dict[Head, Tensor]:
        from gna_lens.interventions import aggregate_mask, gather_mask
        from gna_lens.tasks import build_sample

        iv = self.intervention
        kind = str(iv.mask)
        fn = gather_mask if kind.startswith("gather") else aggregate_mask
        out = torch.ones(len(rows), width, width, dtype=torch.bool, device=self._device)
        for b, (row, off) in enumerate(zip(rows, offsets, strict=True)):
            if row.context is None:
                raise InterventionError(
                    f"mask={kind!r} needs each request's whole context (its segments); this "
                    "request has none: a perplexity (loglikelihood_rolling) request, or a context "
                    f"truncated to max_length={self.max_length}. Fix: ablate heads (remove=...) "
                    "for such tasks, a larger max_length, or no mask."
                )
            chars = _segment_chars(row.context, iv.segments)
            if not chars:
                raise InterventionError(
                    f"mask={kind!r}, segments={iv.segments!r}: no run of two or more segment "
                    f"lines in the context ending {row.context[-160:]!r}, so the mask would "
                    "change nothing. Fix: segments='options' (lines 'A. ...') or 'kv' (lines "
                    "'key: value'), tasks whose prompts have such lines, or no mask."
                )
            sample = build_sample(
                self.tokenizer, row.context, chars, answer_segment=0, choices=[" x"],
                add_special_tokens=self.add_bos_token is not False, boundary="split",
            )  # fmt: skip
            n = len(row.context_tokens)
            if list(sample.input_ids) != row.context_tokens:
                raise InterventionError(
                    f"mask={kind!r}: the context tokenizes to {n} tokens in the request but to "
                    f"{sample.n_tokens} when its segments are located (a truncated or "
                    "BOS-prefixed context); the mask cannot be placed. Fix: shorter prompts "
                    "(max_length) or no mask."
                )
            m = fn(sample, complement=kind.endswith("complement"))
            out[b, off : off + n, off : off + n] = m
        return dict.fromkeys(iv.mask_heads, out)

    def _forward(self, rows: Sequence[_Row], padding: str) -> tuple[Tensor, list[int]]:
        """Logits ``[batch, width, vocab]`` of padded rows under the intervention."""
        from gna_lens.tasks.core import pad_sequences
        from gna_lens.tasks.evaluate import checked_logits

        pad = self.tokenizer.pad_token_id
        pad = self.eot_token_id if pad is None else int(pad)
        ids, attn, offsets = pad_sequences(
            [r.tokens for r in rows],
            padding_side="left" if padding == "left" else "right",
            pad_token_id=pad,
            device=self._device,
        )
        with torch.no_grad(), self.intervened(rows, ids.shape[1], offsets) as model:
            logits = checked_logits(model, ids, attn)
        return logits, offsets

    # ------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(
        self,
        requests: Sequence[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        res: list[tuple[float, bool]] = []
        # As the hf backend: longest first; requests that differ only in their continuation's
        # last token share one forward pass.
        re_ord = Collator(
            requests,
            sort_fn=lambda req: (-len(req[1] + req[2]), tuple(req[1] + req[2])),
            group_by="contexts",
            group_fn=lambda req: req[-2] + req[-1][:-1],
        )
        chunks = re_ord.get_batched(n=override_bs or self.batch_size, batch_fn=None)
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="gna_lens loglikelihood")
        for chunk in chunks:
            rows = []
            for req, context_enc, continuation_enc in chunk:
                if not context_enc or not continuation_enc:
                    raise InterventionError(
                        f"request {req!r}: empty context or continuation tokens; expected both."
                    )
                inp = (context_enc + continuation_enc)[-(self.max_length + 1) :][:-1]
                context_text = req[0] if req is not None else None
                truncated = len(context_enc) + len(continuation_enc) > self.max_length + 1
                rows.append(
                    _Row(
                        tokens=inp,
                        last_context=len(inp) - len(continuation_enc),
                        context=None if truncated else context_text,
                        context_tokens=list(context_enc),
                    )
                )
            logits, _ = self._forward(rows, "right")
            for (req, ctx_tokens, cont_toks), row, lg in zip(chunk, rows, logits, strict=True):
                inplen = len(row.tokens)
                # Only the continuation's positions: a [batch, pos, vocab] log-softmax of a
                # 50k-token vocabulary is gigabytes.
                lp_row = F.log_softmax(lg[inplen - len(cont_toks) : inplen].float(), dim=-1)[None]
                greedy = lp_row.argmax(dim=-1)
                for request_str, cont, lp_one in re_ord.get_cache(
                    req_str=req, cxt_toks=ctx_tokens, cont_toks=cont_toks, logits=lp_row
                ):
                    ct = torch.tensor(cont, dtype=torch.long, device=lp_one.device)[None]
                    is_greedy = bool((greedy[:, -ct.shape[1] :] == ct).all())
                    total = float(torch.gather(lp_one, 2, ct[..., None]).sum())
                    answer = (total, is_greedy)
                    res.append(answer)
                    if request_str is not None:
                        self.cache_hook.add_partial("loglikelihood", request_str, answer)
                    pbar.update(1)
        pbar.close()
        return list(re_ord.get_original(res))

    def loglikelihood_rolling(self, requests: Any, disable_tqdm: bool = False) -> list[float]:
        """Per-document log-likelihood over lm-eval's rolling windows (perplexity tasks)."""
        if self.intervention.mask:
            raise InterventionError(
                f"mask={self.intervention.mask!r}: perplexity (loglikelihood_rolling) requests "
                "have no prompt structure to build a G&A mask from. Fix: remove=... ablation, "
                "or no mask."
            )
        windows: list[tuple[None, list[int], list[int]]] = []
        counts = []
        for (string,) in (req.args for req in requests):
            rolling = [
                lm_utils.make_disjoint_window(w)
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows.extend((None, *w) for w in rolling)
            counts.append(len(rolling))
        results: list[tuple[float, bool]] = []
        for start in range(0, len(windows), self.batch_size):
            batch = windows[start : start + self.batch_size]
            results += self._loglikelihood_tokens(batch, disable_tqdm=True, override_bs=len(batch))
        out: list[float] = []
        pos = 0
        for req, n in zip(requests, counts, strict=True):
            total = sum(r[0] for r in results[pos : pos + n])
            pos += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", tuple(req.args), total)
        return out

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: Any, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation until a stop sequence, EOS or ``max_gen_toks``, batched."""
        res: list[str] = []
        re_ords = Collator(
            [r.args for r in requests],
            sort_fn=lambda req: (-len(self.tok_encode(req[0])), req[0]),
            group_by="gen_kwargs",
            group_fn=lambda x: x[1],
        )
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="gna_lens generate_until")
        for chunk in re_ords.get_batched(n=self.batch_size, batch_fn=None):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = dict(normalize_gen_kwargs(dict(all_kwargs[0]), self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if kwargs.get("do_sample"):
                raise ConfigError(
                    f"generation kwargs {all_kwargs[0]!r} ask for sampling; the gna_lens backend "
                    "decodes greedily only. Fix: do_sample=false / temperature=0."
                )
            max_ctx = self.max_length - max_gen
            if max_ctx <= 0:
                raise ConfigError(
                    f"max_gen_toks={max_gen} leaves no context within max_length="
                    f"{self.max_length}; expected max_gen_toks < max_length."
                )
            outs = self._greedy(list(contexts), max_ctx, max_gen, until)
            for context, text, gk in zip(contexts, outs, all_kwargs, strict=True):
                res.append(text)
                self.cache_hook.add_partial("generate_until", (context, gk), text)
                pbar.update(1)
        pbar.close()
        return list(re_ords.get_original(res))

    def _greedy(
        self, contexts: list[str], max_ctx: int, max_gen: int, until: list[str]
    ) -> list[str]:
        encs = [self.tok_encode(c, left_truncate_len=max_ctx) for c in contexts]
        full = [self.tok_encode(c) for c in contexts]
        gen: list[list[int]] = [[] for _ in contexts]
        done = [False] * len(contexts)
        stops = [s for s in until if s]
        for _ in range(max_gen):
            live = [i for i, d in enumerate(done) if not d]
            if not live:
                break
            rows = [
                _Row(
                    tokens=encs[i] + gen[i],
                    last_context=len(encs[i]) + len(gen[i]) - 1,
                    context=contexts[i] if encs[i] == full[i] else None,
                    context_tokens=encs[i],
                )
                for i in live
            ]
            logits, _ = self._forward(rows, "left")
            nxt = logits[:, -1].float().argmax(-1).tolist()
            for i, t in zip(live, nxt, strict=True):
                if t == self.eot_token_id:
                    done[i] = True
                    continue
                gen[i].append(int(t))
                text = self.tok_decode(gen[i])
                if any(s in text for s in stops):
                    done[i] = True
        return [
            postprocess_generated_text(self.tok_decode(g), stop=until, think_end_token=None)
            for g in gen
        ]


def register() -> None:
    """Register :class:`GnaLM` with lm-eval's model registry as ``"gna_lens"`` (idempotent).

    Imports ``lm_eval.models`` first, so lm-eval's own backends (``hf``, ...) stay findable: lm-eval
    registers them lazily only while its registry is empty.
    """
    import lm_eval.models  # noqa: F401  (registers lm-eval's own backends)

    current = model_registry._objs.get("gna_lens")
    if current is GnaLM:
        return
    if current is not None:  # e.g. gna_lens.lm_eval re-imported: replace the stale class
        objs = dict(model_registry._objs)
        objs["gna_lens"] = GnaLM
        model_registry._objs = objs
        return
    model_registry.register("gna_lens")(GnaLM)
