"""Tiny random models and tokenizers for tests, docstring examples and tutorials (offline).

Every factory builds a Hugging Face config in code and random weights; nothing is downloaded.
:func:`tiny_checkpoint` writes a real checkpoint folder (``save_pretrained``) so tests load it
through the same path a user's hub model takes.

Examples:
    >>> model = tiny_hooked_ssm("mamba1")
    >>> model.cfg.architecture
    'mamba1'
"""

import functools
from pathlib import Path
from typing import Any

import torch

from gna_lens.device import HOST
from gna_lens.heads import HookedModel

__all__ = [
    "ARCHITECTURES",
    "TOY_AGGREGATE_HEAD",
    "TOY_GATHER_HEAD",
    "TOY_GENERIC_HEAD",
    "TOY_WORDS",
    "tiny_checkpoint",
    "tiny_hf_config",
    "tiny_hf_model",
    "tiny_hooked_ssm",
    "tiny_llamba_config",
    "tiny_llamba_state",
    "tiny_tokenizer",
    "toy_control",
    "toy_gna_model",
    "toy_gna_task",
]

#: Architectures the factories can build.
ARCHITECTURES = (
    "mamba1", "falcon_mamba", "mamba2", "bamba", "nemotron_h", "granitemoehybrid", "falcon_h1",
    "jamba", "zamba2", "llama",
)  # fmt: skip

_CORPUS = [
    "Memorize the following dictionary:\napple:12\nriver:47\nstone:3\n",
    "The value of the key 'river' is 47. The value of the key 'apple' is 12.",
    "Below is a list of key-value pairs.\nkey: value\nWhat is the value for key stone?\n",
    "Question: which planet is red?\nA. Mars\nB. Venus\nC. Earth\nD. Jupiter\nAnswer: A",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 10 42 99",
    "the quick brown fox jumps over the lazy dog. hello world! x = y + z;",
]


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer (GPT-NeoX style, no BOS added) trained on a tiny corpus.

    Args:
        vocab_size: Target vocabulary size (at least 258: bytes plus two special tokens).

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with ``<|endoftext|>`` as BOS/EOS and
        ``<|pad|>`` as padding.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
    )


#: Shared by the tiny configs: attention of 4 query / 2 key-value heads; a Mamba-2 mixer of 8
#: heads of 8, 2 groups, state 8 (the ``mamba_`` names of the Mamba-2 hybrids).
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2)
_M2 = dict(
    mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
    mamba_expand=2, mamba_chunk_size=16,
)  # fmt: skip
_LONG = dict(max_position_embeddings=4096)

#: ``arch: (transformers config class, fields)`` of :func:`tiny_hf_config` (``hidden_size=32``).
_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "mamba1": ("MambaConfig", dict(
        num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, time_step_rank=4,
        use_conv_bias=True)),
    "mamba2": ("Mamba2Config", dict(
        num_hidden_layers=2, state_size=8, expand=2, num_heads=8, head_dim=8, n_groups=2,
        conv_kernel=4, chunk_size=16)),
    "bamba": ("BambaConfig", dict(
        num_hidden_layers=3, intermediate_size=64, attn_layer_indices=[1], pad_token_id=1,
        **_ATTN, **_M2, **_LONG)),
    # Mamba-2, attention (no RoPE), MLP-only, Mamba-2, MoE.
    "nemotron_h": ("NemotronHConfig", dict(
        layers_block_type=["mamba", "attention", "mlp", "mamba", "moe"], intermediate_size=64,
        head_dim=8, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
        conv_kernel=4, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=2,
        topk_group=1, routed_scaling_factor=1.5, **_ATTN, **_LONG)),
    # Granite's multipliers away from 1, so that the parity tests see them.
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(
        num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], intermediate_size=16,
        shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        position_embedding_type="rope", embedding_multiplier=3.0, attention_multiplier=0.2,
        residual_multiplier=0.5, logits_scaling=2.0, **_ATTN, **_M2, **_LONG)),
    # Falcon-H1's multipliers away from 1, so that the parity tests see them.
    "falcon_h1": ("FalconH1Config", dict(
        num_hidden_layers=3, intermediate_size=48, head_dim=8, mamba_d_ssm=64,
        mamba_rms_norm=True, mamba_norm_before_gate=False, embedding_multiplier=2.0,
        lm_head_multiplier=0.5, attention_in_multiplier=1.5, attention_out_multiplier=0.7,
        key_multiplier=0.8, ssm_in_multiplier=1.25, ssm_out_multiplier=0.6,
        ssm_multipliers=[0.9, 1.1, 1.2, 0.8, 1.3], mlp_multipliers=[1.2, 0.75],
        **_ATTN, **_M2, **_LONG)),
    # Mamba-1 + dense MLP, attention + MoE, Mamba-1 + dense, Mamba-1 + MoE, attention + dense.
    "jamba": ("JambaConfig", dict(
        num_hidden_layers=5, attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, intermediate_size=48,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, **_ATTN, **_LONG)),
    # Mamba-2, hybrid (shared block 0), Mamba-2, hybrid (block 1), hybrid (block 0 again).
    "zamba2": ("Zamba2Config", dict(
        num_hidden_layers=5, layers_block_type=["linear_attention", "hybrid"] * 2 + ["hybrid"],
        num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True,
        intermediate_size=48, num_attention_heads=4, n_mamba_heads=8, mamba_ngroups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, chunk_size=16, **_LONG)),
    "llama": ("LlamaConfig", dict(
        num_hidden_layers=2, intermediate_size=64, max_position_embeddings=512, **_ATTN)),
}  # fmt: skip
_TINY["falcon_mamba"] = ("FalconMambaConfig", _TINY["mamba1"][1])


def tiny_hf_config(arch: str, vocab_size: int = 320, **overrides: Any) -> Any:
    """A small Hugging Face config of ``arch`` (one of :data:`ARCHITECTURES`).

    Args:
        arch: One of :data:`ARCHITECTURES` (``"mamba1"``, ..., ``"jamba"``, ``"llama"``).
        vocab_size: Vocabulary size (match the tokenizer's).
        **overrides: Config fields to change (e.g. ``n_groups=2``, ``chunk_size=8``).

    Returns:
        The config object.

    Raises:
        ValueError: For an unknown ``arch``.
    """
    import transformers as tf

    if arch not in _TINY:
        raise ValueError(f"tiny_hf_config: unknown arch {arch!r}; expected one of {ARCHITECTURES}.")
    class_name, kw = _TINY[arch]
    ids = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=0)
    return getattr(tf, class_name)(
        **{"hidden_size": 32, "pad_token_id": 1, **kw, **ids, **overrides}
    )


def tiny_hf_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """A random Hugging Face causal LM of ``arch`` in fp32 eval mode.

    The SSM parameters are given spread-out values (decays, step sizes, skip terms) so that the
    implicit attention is far from uniform and parity tests exercise every term.

    Args:
        arch: One of :data:`ARCHITECTURES`.
        seed: Random seed.
        **overrides: Config fields to change.

    Returns:
        The model.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(arch, **overrides)
    if arch == "llama":
        config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen, device=HOST) * 2.0 - 1.0)
            elif name.endswith("dt_bias") or name.endswith("dt_proj.bias"):
                p.copy_(torch.rand(p.shape, generator=gen, device=HOST) * 2.0 - 1.5)
            elif name.endswith(".D"):
                p.copy_(torch.randn(p.shape, generator=gen, device=HOST))
            elif name.endswith(("dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight")):
                # Jamba's norms inside the mixer: away from 1 so the parity tests see them.
                p.copy_(torch.rand(p.shape, generator=gen, device=HOST) + 0.5)
            elif p.ndim >= 2:
                # Low-rank adapters (Zamba2) are small corrections of the weights they adapt.
                scale = 0.25 if "adapter" in name else 1.0
                p.copy_(
                    torch.randn(p.shape, generator=gen, device=HOST) * (scale / p.shape[-1] ** 0.5)
                )
    return model.eval()


def tiny_llamba_config(vocab_size: int = 320, **overrides: Any) -> dict[str, Any]:
    """A small Llamba ``config.json`` in Cartesia's layout (``LlambaConfig``'s fields, no
    ``model_type``, as ``cartesia-pytorch`` writes it): 2 layers of ``d_model`` 32, 4 value
    heads of 8 sharing 2 ``B`` / ``C`` heads of state 8.

    Args:
        vocab_size: Vocabulary size (match the tokenizer's; Cartesia pads it to a multiple of
            ``pad_vocab_size_multiple``).
        **overrides: Top-level fields to change; ``ssm_cfg`` / ``mlp_cfg`` dicts are merged into
            the defaults (``ssm_cfg={"n_qk_heads": 4}``).

    Examples:
        >>> tiny_llamba_config(ssm_cfg={"n_qk_heads": 1})["ssm_cfg"]["n_qk_heads"]
        1
    """
    config: dict[str, Any] = dict(
        d_model=32, n_layer=2, vocab_size=vocab_size, pad_vocab_size_multiple=8,
        tie_embeddings=False, lm_head_bias=False, norm_epsilon=1e-5, resid_dropout=0.0,
        mlp_cfg=dict(intermediate_size=64, bias=False, act_fn="silu"),
        ssm_cfg=dict(d_state=8, n_v_heads=4, n_qk_heads=2, expand=1, d_conv=4, chunk_size=8,
                     activation="identity", bias=False, conv_bias=True),
    )  # fmt: skip
    for key, value in overrides.items():
        config[key] = {**config[key], **value} if key in ("ssm_cfg", "mlp_cfg") else value
    return config


def tiny_llamba_state(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of a Llamba ``config`` (:func:`tiny_llamba_config`) under Cartesia's names
    (``backbone.layers.{l}.mixer.in_proj.weight``, ...), written from Cartesia's layout, not from
    HookedSSM's modules. The step-size rows of ``in_proj``, ``D``, ``z_bias`` and the norms get
    spread-out values so that parity tests exercise every term.

    Examples:
        >>> state = tiny_llamba_state(tiny_llamba_config())
        >>> tuple(state["backbone.layers.0.mixer.in_proj.weight"].shape)  # [x B C | z | dt] rows
        (100, 32)
    """
    gen = torch.Generator().manual_seed(seed)
    d = int(config["d_model"])
    ssm, mlp = config["ssm_cfg"], config["mlp_cfg"]
    E = int(ssm.get("d_inner") or int(ssm.get("expand", 1)) * d)
    H, G, N = int(ssm["n_v_heads"]), int(ssm["n_qk_heads"]), int(ssm["d_state"])
    K, ff = int(ssm.get("d_conv", 4)), int(mlp["intermediate_size"])
    vocab = int(config["vocab_size"])
    multiple = int(config.get("pad_vocab_size_multiple", 8) or 1)
    vocab += (-vocab) % multiple
    conv_dim = E + 2 * G * N

    def w(*shape: int, scale: float | None = None) -> torch.Tensor:
        s = scale if scale is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=gen, device=HOST) * s

    def norm(n: int) -> torch.Tensor:
        return torch.rand(n, generator=gen, device=HOST) + 0.5

    tied = bool(config.get("tie_embeddings", False))
    state = {"backbone.embedding.weight": w(vocab, d, scale=None if tied else 1.0)}
    for layer in range(int(config["n_layer"])):
        p = f"backbone.layers.{layer}."
        in_proj = w(conv_dim + E + H, d)
        in_proj[conv_dim + E :] *= 3.0  # step sizes softplus(a) from ~0.05 to ~3
        state[p + "input_layernorm.weight"] = norm(d)
        state[p + "mixer.in_proj.weight"] = in_proj
        if ssm.get("bias", False):
            state[p + "mixer.in_proj.bias"] = w(conv_dim + E + H, scale=0.5)
        else:
            state[p + "mixer.z_bias"] = w(E, scale=1.0)
        state[p + "mixer.conv1d.weight"] = w(conv_dim, 1, K, scale=0.5)
        if ssm.get("conv_bias", True):
            state[p + "mixer.conv1d.bias"] = w(conv_dim, scale=0.5)
        state[p + "mixer.D"] = w(H, scale=1.0)
        state[p + "mixer.out_proj.weight"] = w(d, E)
        if ssm.get("bias", False):
            state[p + "mixer.out_proj.bias"] = w(d, scale=0.5)
        state[p + "post_attention_layernorm.weight"] = norm(d)
        for name, shape in (("gate_proj", (ff, d)), ("up_proj", (ff, d)), ("down_proj", (d, ff))):
            state[p + f"mlp.{name}.weight"] = w(*shape)
            if mlp.get("bias", False):
                state[p + f"mlp.{name}.bias"] = w(shape[0], scale=0.5)
    state["backbone.final_layernorm.weight"] = norm(d)
    if not tied:
        state["lm_head.weight"] = w(vocab, d)
    return state


def _write_llamba(path: Path, seed: int, **overrides: Any) -> Path:
    import json

    from safetensors.torch import save_file

    config = tiny_llamba_config(**overrides)
    save_file(tiny_llamba_state(config, seed), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def tiny_checkpoint(arch: str, path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random checkpoint (weights, config and tokenizer) to ``path``.

    Args:
        arch: One of :data:`ARCHITECTURES`, or ``"llamba"``: a checkpoint in Cartesia's layout
            (:func:`tiny_llamba_config`, :func:`tiny_llamba_state`; no transformers class).
        path: Folder to create.
        seed: Random seed.
        **overrides: Config fields to change.

    Returns:
        The folder, loadable with ``from_pretrained`` like a hub model.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if arch == "llamba":
        _write_llamba(path, seed, **overrides)
    else:
        tiny_hf_model(arch, seed=seed, **overrides).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def tiny_hooked_ssm(arch: str = "mamba2", seed: int = 0, **overrides: Any) -> Any:
    """A tiny random :class:`~gna_lens.models.HookedSSM` with a tokenizer, built in memory.

    Args:
        arch: One of :data:`ARCHITECTURES` but ``"llama"``, or ``"llamba"`` (read from a
            checkpoint in Cartesia's layout, :func:`tiny_checkpoint`).
        seed: Random seed.
        **overrides: Config fields to change.

    Returns:
        The model in fp32 eval mode.
    """
    from gna_lens.models import HookedSSM

    if arch == "llamba":
        import tempfile

        from gna_lens.models.families import llamba

        with tempfile.TemporaryDirectory() as folder:
            model = llamba.load(tiny_checkpoint("llamba", folder, seed=seed, **overrides))
            model.cfg.model_name = "tiny-llamba"
            return model
    return HookedSSM.from_hf_model(tiny_hf_model(arch, seed=seed, **overrides), tiny_tokenizer())


#: Keys (line starts) and values (after a space) of :func:`toy_gna_model`'s vocabulary.
TOY_WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "lemon", "house", "chair", "bread", "plant",
    "horse", "glass",
)  # fmt: skip

#: The toy model's known Gather head and Aggregate head.
TOY_GATHER_HEAD = (0, 0)
TOY_AGGREGATE_HEAD = (1, 0)
#: The generic head of ``toy_gna_model(generic_head=True)``: every prediction needs it.
TOY_GENERIC_HEAD = (0, 2)


def toy_gna_template() -> Any:
    """The KV template the toy model retrieves in: lines ``"apple red\\n"``, query ``"apple"``."""
    from gna_lens.tasks import KVTemplate

    return KVTemplate(
        header="", line="{key} {value}\n", query="{key}", answer=" {value}", name="toy"
    )


def toy_gna_task(model: HookedModel, n_pairs: int = 4, n_samples: int = 16, seed: int = 0) -> Any:
    """A KV-retrieval task over :data:`TOY_WORDS` that :func:`toy_gna_model` solves."""
    from gna_lens.tasks import kv_retrieval

    return kv_retrieval(
        model.tokenizer,
        n_pairs=n_pairs,
        n_samples=n_samples,
        seed=seed,
        template=toy_gna_template(),
        values="words",
        words=TOY_WORDS,
        add_special_tokens=False,
    )


def toy_control(model: HookedModel, n_sequences: int = 8, seq_len: int = 16, seed: int = 0) -> Any:
    """A control text for :func:`toy_gna_model`: chains of key words in a fixed cyclic order.

    Each window follows :data:`TOY_WORDS` cyclically from a seeded start (``apple river stone
    ...``); ``toy_gna_model(generic_head=True)`` predicts every next word through its generic
    head (and nothing else), so removing that head breaks this control and removing the G&A
    heads does not.

    Returns:
        A :class:`~gna_lens.tasks.TextControl` (no BOS: the toy prompts have none either).
    """
    import random

    from gna_lens.tasks import TextControl

    tok = model.tokenizer
    ids = [tok.convert_tokens_to_ids(w) for w in TOY_WORDS]
    rng = random.Random(seed)
    rows = []
    for _ in range(n_sequences):
        start = rng.randrange(len(ids))
        rows.append([ids[(start + i) % len(ids)] for i in range(seq_len)])
    return TextControl(
        name="toy-chains",
        tokens=torch.tensor(rows, dtype=torch.long, device=HOST),
        source="cyclic chains of the toy's key words",
        split="all",
    )


def toy_gna_model(generic_head: bool = False) -> Any:
    """A two-layer attention-only model whose weights implement a known Gather-and-Aggregate pair.

    Built by hand (no training) as a :class:`~gna_lens.models.HookedSSM` hybrid whose two layers
    are attention layers (MLPs zeroed), on prompts of :func:`toy_gna_task`:

    - Gather head ``(0, 0)``: each line's ``\\n`` (its summary token) attends to its own line's
      value and key (content match plus a RoPE recency term) and copies both into the residual.
    - Aggregate head ``(1, 0)``: the final token (the queried key) attends to the ``\\n`` whose
      gathered key matches it and copies that line's value to the output, which the unembedding
      reads as the answer's logit.

    Every other head has zero weights (uniform pattern, no output). The residual stream has one
    dimension per feature: key identity, value identity, a newline flag, a bias, the gathered key
    and value, and the output value.

    With ``generic_head=True`` each layer has a third head and head ``(0, 2)``
    (:data:`TOY_GENERIC_HEAD`) is one that *every* prediction needs: it attends to the current
    token and copies its identity into a "current word" feature, which the Aggregate head's query
    reads (``2 * current - key``: without the generic head the query points away from the
    queried line, so retrieval fails worse than without the G&A heads) and which the unembedding
    maps to the next word of :func:`toy_control`'s chains. Removing it breaks retrieval *and*
    the control; removing a G&A head breaks only retrieval.

    Args:
        generic_head: Add the generic head (the model then has 96 dimensions and 3 heads per
            layer).

    Returns:
        The model (fp32, eval mode) with its word-level tokenizer attached.

    Examples:
        >>> model = toy_gna_model()
        >>> task = toy_gna_task(model, n_pairs=3, n_samples=4)
        >>> from gna_lens.tasks import evaluate
        >>> evaluate(model, task, progress=False).accuracy
        1.0
    """
    import transformers as tf

    from gna_lens.models import HookedSSM
    from gna_lens.tasks.toy_tokenizers import word_tokenizer

    n = len(TOY_WORDS)
    tok = word_tokenizer([" ".join(TOY_WORDS)])
    key_ids = [tok.convert_tokens_to_ids(w) for w in TOY_WORDS]
    val_ids = [tok.convert_tokens_to_ids(" " + w) for w in TOY_WORDS]
    nl_id = tok.convert_tokens_to_ids("\n")
    # Residual layout.
    KEY, VAL, NL, BIAS, GK, GV, OUT = 0, n, 2 * n, 2 * n + 1, 2 * n + 2, 3 * n + 2, 4 * n + 2
    CUR = 5 * n + 2  # generic head's "current word" (generic_head=True only)
    n_heads = 3 if generic_head else 2
    d_model, d_head, theta = 32 * n_heads, 32, 0.05
    config = tf.BambaConfig(
        vocab_size=len(tok),
        hidden_size=d_model,
        num_hidden_layers=2,
        intermediate_size=8,
        num_attention_heads=n_heads,
        num_key_value_heads=n_heads,
        attn_layer_indices=[0, 1],
        mamba_n_heads=2,
        mamba_d_head=d_model,
        mamba_n_groups=1,
        mamba_d_state=4,
        mamba_expand=2,
        # Rotary dims 0..15 (partial factor 0.5); pair (7, 15) turns at `theta` per position.
        rope_parameters={"rope_type": "default", "rope_theta": theta ** (-8 / 7)},
        max_position_embeddings=1024,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        rms_norm_eps=1e-6,
    )
    model = HookedSSM.from_hf_model(tf.BambaForCausalLM(config).eval(), tok)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        blocks: Any = model.blocks
        for norm in [model.ln_final] + [m for b in blocks for m in (b.ln1, b.ln2)]:
            norm.weight.fill_(1.0)
        E = model.embed.weight
        E[:, BIAS] = 1.0
        for i in range(n):
            E[key_ids[i], KEY + i] = 1.0
            E[val_ids[i], VAL + i] = 1.0
        E[nl_id, NL] = 1.0
        s = (d_model / 2) ** 0.5  # RMSNorm's scale for a one-feature-plus-bias token
        c = d_head**0.5  # undo the attention's 1/sqrt(d_head)
        g = blocks[0].attn  # Gather head: rows 0..31 of q/k/v, columns 0..31 of o
        g.q_proj.weight[7, NL] = c * 300 / s  # recency: score 300 cos(theta * distance)
        g.k_proj.weight[7, BIAS] = 1 / s
        g.q_proj.weight[16, NL] = c * 10 / s  # content: +10 for key and value tokens
        for i in range(n):
            g.k_proj.weight[16, KEY + i] = 1 / s
            g.k_proj.weight[16, VAL + i] = 1 / s
            g.v_proj.weight[i, KEY + i] = 1 / s
            g.v_proj.weight[n + i, VAL + i] = 1 / s
            g.o_proj.weight[GK + i, i] = 2.0
            g.o_proj.weight[GV + i, n + i] = 2.0
        a = blocks[1].attn  # Aggregate head
        for i in range(n):
            a.k_proj.weight[16 + i, GK + i] = 4.0
            a.v_proj.weight[i, GV + i] = 1.0
            a.o_proj.weight[OUT + i, i] = 3.0
            model.unembed.weight[val_ids[i], OUT + i] = 5.0
            if not generic_head:
                a.q_proj.weight[16 + i, KEY + i] = c * 8.0 / s
                # Only newlines are read: other tokens' (diffuse) gathered keys are outweighed.
                a.k_proj.weight[16 + i, NL] = 10.0
                a.k_proj.weight[16 + i, BIAS] = -10.0
        if generic_head:
            # The query is 2 * current - key; the newline gate lives on its own dimension (28)
            # so that a query pointing away from the queried line still reads only newlines.
            for i in range(n):
                a.q_proj.weight[16 + i, CUR + i] = 2 * c * 8.0 / s
                a.q_proj.weight[16 + i, KEY + i] = -c * 8.0 / s
            a.q_proj.weight[28, BIAS] = c * 40.0 / s
            a.k_proj.weight[28, NL] = 1.0
            a.k_proj.weight[28, BIAS] = -1.0
            gen = 64  # generic head (0, 2): rows 64..95 of q/k/v, columns 64..95 of o
            # Self-attention by recency: score 8000 cos(theta * distance), sharp at distance 0.
            g.q_proj.weight[gen + 7, BIAS] = c * 8000 / s
            g.k_proj.weight[gen + 7, BIAS] = 1 / s
            for i in range(n):
                g.v_proj.weight[gen + i, KEY + i] = 1 / s
                g.o_proj.weight[CUR + i, gen + i] = 1.0
                # The control's next word: key word i is followed by key word i + 1.
                model.unembed.weight[key_ids[(i + 1) % n], CUR + i] = 6.0
    return model
