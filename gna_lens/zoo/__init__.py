"""The zoo: small models gna_lens trains itself, shipped inside the package, usable offline.

No registry ships SSM weights small enough for tests and tutorials, so gna_lens trains its own on
a synthetic curriculum (:mod:`gna_lens.zoo.curriculum`) that needs both in-context retrieval
(key-value dictionaries, letter-format multiple choice) and parametric knowledge (a fixed world
of facts), one per architecture family, with the same tokenizer and comparable sizes:

- ``zoo-llama``: a Llama-architecture Transformer (loads as a TransformerLens bridge);
- ``zoo-mamba2``: a Mamba-2; ``zoo-mamba1``: a Mamba-1 (load as :class:`~gna_lens.HookedSSM`);
- ``zoo-bamba``: a Bamba hybrid, Mamba-2 layers and one attention layer (HookedSSM).

Each checkpoint is an ordinary Hugging Face folder (:func:`path`) with a ``card.json`` /
``README.md`` of measured accuracies on held-out splits (:func:`card`, :func:`tasks`).
``gna-lens train-zoo`` retrains them (:func:`gna_lens.zoo.train.train_zoo_main`).

Examples:
    >>> from gna_lens import zoo
    >>> "zoo-llama" in zoo.names()
    True
    >>> zoo.card("zoo-llama").n_params > 100_000
    True
    >>> sorted(zoo.tasks())
    ['cloze', 'kv-16', 'kv-2', 'kv-4', 'kv-8', 'letter', 'letter-unseen']
"""

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gna_lens.errors import ConfigError, TaskError
from gna_lens.tasks.control import AUTO_CONTROLS

__all__ = [
    "MODELS_DIR",
    "ZooCard",
    "card",
    "control",
    "load",
    "names",
    "path",
    "scan_tasks",
    "tasks",
]

#: Where the zoo's checkpoints lie inside the installed package.
MODELS_DIR = Path(__file__).resolve().parent / "models"


@dataclass(frozen=True)
class ZooCard:
    """What a zoo model is and how well it does (``card.json``).

    Attributes:
        name: The zoo name.
        architecture: The Hugging Face class (``"LlamaForCausalLM"``).
        model_type: The Hugging Face ``model_type``.
        n_params: Number of parameters.
        steps: Training steps.
        train_seconds: Training wall time.
        seed: Training seed.
        accuracy: Held-out accuracy per task of :func:`tasks` (``{"kv-8": 0.93, ...}``).
        chance: Accuracy of uniform guessing per task.
        n_samples: Evaluation samples per task.
        raw: The whole ``card.json``.
    """

    name: str
    architecture: str
    model_type: str
    n_params: int
    steps: int
    train_seconds: float
    seed: int
    accuracy: dict[str, float]
    chance: dict[str, float]
    n_samples: dict[str, int]
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    def to_dataframe(self) -> Any:
        """One row per task: ``task``, ``accuracy``, ``chance``, ``n``."""
        import pandas as pd

        return pd.DataFrame(
            {
                "model": self.name,
                "task": list(self.accuracy),
                "accuracy": list(self.accuracy.values()),
                "chance": [self.chance[k] for k in self.accuracy],
                "n": [self.n_samples[k] for k in self.accuracy],
            }
        )


def names() -> list[str]:
    """The zoo models shipped with this installation, sorted.

    Examples:
        >>> names()
        ['zoo-bamba', 'zoo-llama', 'zoo-mamba1', 'zoo-mamba2']
    """
    return sorted(p.name for p in MODELS_DIR.glob("zoo-*") if (p / "config.json").is_file())


def path(name: str) -> Path:
    """The Hugging Face checkpoint folder of a zoo model (loadable by plain ``transformers``).

    Args:
        name: A zoo name (see :func:`names`).

    Raises:
        ConfigError: For an unknown name.

    Examples:
        >>> from transformers import AutoConfig
        >>> AutoConfig.from_pretrained(path("zoo-mamba2")).model_type
        'mamba2'
    """
    if not isinstance(name, str) or not (MODELS_DIR / name / "config.json").is_file():
        raise ConfigError(
            f"zoo model {name!r} not found; expected one of {names()} (the checkpoints under "
            f"{MODELS_DIR}). Retrain missing ones with `gna-lens train-zoo NAME --out {MODELS_DIR}`."
        )
    return MODELS_DIR / name


def load(name: str, **kwargs: Any) -> Any:
    """Load a zoo model through :func:`gna_lens.load_model` (offline).

    Args:
        name: A zoo name.
        **kwargs: Passed to :func:`gna_lens.load_model` (``dtype``, ``device``).

    Returns:
        A ``TransformerBridge`` (``zoo-llama``) or a :class:`~gna_lens.HookedSSM` (the others),
        with the zoo tokenizer attached.

    Examples:
        >>> model = load("zoo-mamba2")
        >>> type(model).__name__, model.cfg.n_layers
        ('HookedSSM', 4)
    """
    from gna_lens.models import load_model

    return load_model(str(path(name)), **kwargs)


@functools.cache
def _card_json(name: str) -> str:
    return (path(name) / "card.json").read_text(encoding="utf-8")


def card(name: str) -> ZooCard:
    """The model card of a zoo model: architecture, training and measured accuracies.

    Examples:
        >>> c = card("zoo-llama")
        >>> c.architecture, sorted(c.accuracy) == sorted(tasks())
        ('LlamaForCausalLM', True)
    """
    raw = json.loads(_card_json(name))
    acc = raw["accuracy"]
    return ZooCard(
        name=raw["name"],
        architecture=raw["architecture"],
        model_type=raw["model_type"],
        n_params=int(raw["training"]["n_params"]),
        steps=int(raw["training"]["steps"]),
        train_seconds=float(raw["training"]["train_seconds"]),
        seed=int(raw["training"]["seed"]),
        accuracy={k: float(v["accuracy"]) for k, v in acc.items()},
        chance={k: float(v["chance"]) for k, v in acc.items()},
        n_samples={k: int(v["n"]) for k, v in acc.items()},
        raw=raw,
    )


def tokenizer() -> Any:
    """The zoo's word-level tokenizer (the same for every zoo model)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path(names()[0]))


def tasks(name_or_tokenizer: str | Any | None = None) -> dict[str, Any]:
    """The held-out evaluation splits the cards report, as :class:`gna_lens.tasks.Task` objects
    (what each is: :func:`gna_lens.zoo.curriculum.eval_tasks`).

    Args:
        name_or_tokenizer: ``None`` or a zoo name (the zoo tokenizer), or any HF fast tokenizer
            (e.g. ``model.tokenizer``) that keeps the world's words whole.

    Returns:
        ``{task name: Task}``.

    Examples:
        >>> t = tasks()
        >>> len(t["kv-8"]), t["letter"][0].choices
        (200, [' A', ' B', ' C', ' D'])
    """
    from gna_lens.zoo.curriculum import eval_tasks

    if name_or_tokenizer is None or isinstance(name_or_tokenizer, str):
        from transformers import AutoTokenizer

        folder = path(name_or_tokenizer) if name_or_tokenizer else path(names()[0])
        return _cached_tasks(str(folder), AutoTokenizer)
    if isinstance(name_or_tokenizer, Mapping):
        raise ConfigError(
            f"tasks({type(name_or_tokenizer).__name__}); expected None, a zoo name or a tokenizer."
        )
    return eval_tasks(name_or_tokenizer)


def control(name_or_tokenizer: str | Any | None = None, split: str = "select") -> Any:
    """The zoo's knowledge control: the cloze split (a fact answered from the weights, no look-up).

    The zoo's tokenizer reads prose as ``<unk>``, so the prose control does not apply to zoo
    models; the answer's next-token loss on cloze questions does. ``split="select"`` is the first
    half of the 300 cloze prompts (for ranking heads), ``"eval"`` the second half (for the
    held-out measurement).

    Args:
        name_or_tokenizer: As for :func:`tasks`.
        split: ``"select"`` or ``"eval"``.

    Returns:
        A :class:`gna_lens.tasks.Task` to pass as ``control=``.

    Raises:
        ConfigError: For another ``split``.

    Examples:
        >>> len(control(split="select")), control(split="eval").name
        (150, 'cloze-eval (cloze prompts 150-299)')
    """
    if split not in ("select", "eval"):
        raise ConfigError(f"zoo.control(split={split!r}); expected 'select' or 'eval'.")
    cloze = tasks(name_or_tokenizer)["cloze"]
    half = len(cloze) // 2
    part = cloze[:half] if split == "select" else cloze[half:]
    first, last = (0, half - 1) if split == "select" else (half, len(cloze) - 1)
    return dataclasses.replace(part, name=f"cloze-{split} (cloze prompts {first}-{last})")


@functools.lru_cache(maxsize=8)
def _cached_tasks(folder: str, auto: Any) -> dict[str, Any]:
    from gna_lens.zoo.curriculum import eval_tasks

    return eval_tasks(auto.from_pretrained(folder))


def scan_tasks(tokenizer: Any, task: str = "kv", n_samples: int = 24, n_eval: int = 48) -> Any:
    """A zoo model's prompts for :func:`gna_lens.scan.scan` (``tasks=``; the CLI passes them for
    zoo names): its ``kv-8`` (``task="kv"``) or ``letter`` (``"mc"``) split, the first
    ``n_samples`` prompts to select and the next ``n_eval`` held out, and its ``cloze`` split as
    the control (first half selects, second half evaluates).

    Args:
        tokenizer: The zoo's tokenizer (``zoo.load(name).tokenizer``).
        task: ``"kv"`` or ``"mc"``.
        n_samples: Selection prompts.
        n_eval: Held-out prompts per task.

    Returns:
        A :class:`gna_lens.scan.ScanTasks`.

    Raises:
        TaskError: For another task, or a split too short to leave prompts held out.
    """
    from gna_lens.scan import ScanTasks

    splits = tasks(tokenizer)
    name = {"kv": "kv-8", "mc": "letter"}.get(task)
    if name is None:
        raise TaskError(
            f"--task {task!r} on a zoo model; expected 'kv' (the zoo's kv-8 split) or 'mc' (its "
            "letter split; the cloze split is the control)."
        )
    probe = splits[name]
    selection = probe[:n_samples]
    start = n_samples
    if name == "letter":
        # The letter and cloze splits ask the same questions (same prompts, letters vs answer
        # words): the cloze control's selection half took part in choosing the heads, so
        # held-out questions start after it, in both formats.
        start = max(n_samples, len(splits["cloze"]) // 2)
    held = {name: probe[start : start + n_eval]}
    if not len(held[name]):
        raise TaskError(
            f"the zoo's {name} split has {len(probe)} prompts; --n-samples {n_samples} leaves "
            f"none held out (they would start after prompt {start}). Fix: a smaller --n-samples."
        )
    if name == "letter":
        held["cloze"] = splits["cloze"][start : start + n_eval]
    return ScanTasks(
        selection,
        held,
        control_select=control(tokenizer, "select"),
        control_eval=control(tokenizer, "eval"),
        notes={
            "zoo": f"selection: first {n_samples} of the zoo's {name} split; held out: "
            f"{len(held[name])} from prompt {start}; control: answer NLL among the options of "
            "the cloze split (first half selects, second half evaluates; letter and cloze "
            "prompts are the same questions, so held-out letter questions come from the "
            "second half)"
        },
    )


@functools.cache
def _zoo_vocab() -> tuple[tuple[str, int], ...]:
    return tuple(sorted(tokenizer().get_vocab().items()))


def _auto_control(tok: Any, split: str) -> Any:
    """``control="auto"`` on the zoo's tokenizer (which reads prose as ``<unk>``): its cloze split."""
    get_vocab = getattr(tok, "get_vocab", None)
    if get_vocab is None or tuple(sorted(get_vocab().items())) != _zoo_vocab():
        return None
    cloze = control(tok, "eval" if split == "eval" else "select")
    why = "control='auto': the zoo's cloze split, since the zoo tokenizer reads prose as <unk>"
    return dataclasses.replace(cloze, name=f"{cloze.name}; {why}")


AUTO_CONTROLS.append(_auto_control)
