"""The DiscreteMamba2 mixer of Cartesia's Llamba models (Llama-3.x distilled into Mamba-2-style
layers by MOHAWK; Bick et al. 2025, "Llamba: Scaling Distilled Recurrent Models for Efficient
Language Processing").

Per layer, from the normed input ``u`` (``E = d_inner``, ``H = n_v_heads`` value heads of size
``P = E / H``, ``G = n_qk_heads`` heads of ``B`` / ``C`` of size ``N = d_state``, each shared by
``H / G`` value heads)::

    xBC, z, a = in_proj(u)                    sections [E + 2 G N | E | H], in this order
    x, B, C   = act(conv1d(xBC))              causal depthwise convolution; act = identity
                                              (Llamba's configs) or SiLU
    dt        = softplus(a)                   per value head and position (no dt bias)
    h_t       = exp(-dt_t) h_{t-1} + x_t B_tᵀ   the Mamba-2 recurrence with A = -1 and input
                                              x / dt scaled back by dt: dt only decays
    y_t       = C_t h_t + D x_t
    out       = out_proj(y * SiLU(z + z_bias))  no norm; z_bias exists when in_proj has no bias

so the implicit attention of head ``h`` is ``M[i, j] = (C_i · B_j) exp(-Σ_{k=j+1..i} dt_k)``
(no trailing ``dt_j``, unlike Mamba-2's), the matrix Cartesia's ``materialize_mixer`` returns
without its ``D`` diagonal, and ``y = M @ x + D x``.

The mixer is a variant of :class:`~gna_lens.models.mixers.Mamba2Mixer`: the same hook points
(``hook_ssm_B`` / ``hook_ssm_C`` hold the ``G`` qk heads as groups, ``hook_ssm_dt`` holds
``softplus(a)``, ``hook_gate`` holds ``z + z_bias``), the same fast path (the chunked SSD scan or
``mamba_chunk_scan_combined`` on ``x / dt``, as Cartesia calls it), materialized and editable
``hook_pattern``, ``hook_ssm_state``, ``prefix_state`` and ``step``. ``A_log`` is a zero buffer
(``A = -exp(0) = -1``), not a weight: Llamba checkpoints have none.
"""

import torch
from torch import Tensor, nn

from gna_lens.errors import ConfigError
from gna_lens.models.config import SSMConfig
from gna_lens.models.mixers.base import SSMMixer
from gna_lens.models.mixers.mamba2 import Mamba2Mixer

__all__ = ["CONV_ACTIVATIONS", "DiscreteMamba2Mixer"]

#: The activations after the convolution DiscreteMamba2 implements (``SSMConfig.conv_activation``).
CONV_ACTIVATIONS = ("identity", "silu")


class DiscreteMamba2Mixer(Mamba2Mixer):
    """Llamba's DiscreteMamba2 mixer (module docstring): ``n_v_heads`` value heads sharing
    ``n_qk_heads`` ``B`` / ``C`` heads, ``A = -1``, ``dt = softplus(in_proj)``, input scaled by
    ``1 / dt``, ``D`` skip, ``z`` gate with its bias, no norm.

    Config fields read: ``d_model``, ``d_inner``, ``n_heads`` (``n_v_heads``), ``d_head``,
    ``n_groups`` (``n_qk_heads``), ``d_state``, ``d_conv``, ``chunk_size``, ``conv_bias``,
    ``proj_bias`` (Cartesia's ``bias``: ``in_proj`` and ``out_proj`` biases, and then no
    ``z_bias``) and ``conv_activation``.

    ``hook_pattern`` is ``[batch, head_index, query_pos, key_pos]`` in the form
    ``M = (C_i · B_j) exp(-Σ_{k=j+1..i} dt_k)`` (``y = M @ x + D x``).

    Examples:
        >>> import torch
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("llamba")
        >>> mixer = model.blocks[0].mixer
        >>> type(mixer).__name__, model.cfg.n_heads, model.cfg.n_groups
        ('DiscreteMamba2Mixer', 4, 2)
        >>> _, cache = model.run_with_cache("a b c", names_filter=lambda n: "blocks.0.mixer" in n)
        >>> M, x = cache["blocks.0.mixer.hook_pattern"], cache["blocks.0.mixer.hook_ssm_input"]
        >>> y = torch.einsum("bhij,bjhp->bihp", M, x) + x * mixer.D[:, None]
        >>> torch.allclose(y, cache["blocks.0.mixer.hook_ssm_out"], atol=1e-5)
        True
    """

    pattern_scales_keys = False

    def __init__(self, cfg: SSMConfig):
        SSMMixer.__init__(self, cfg)  # not Mamba2Mixer's: other weights, in another order
        E, H, G, N = cfg.d_inner, cfg.n_heads, cfg.n_groups, cfg.d_state
        if cfg.conv_activation not in CONV_ACTIVATIONS:
            raise ConfigError(
                f"DiscreteMamba2: conv_activation={cfg.conv_activation!r}; expected one of "
                f"{list(CONV_ACTIVATIONS)} (Cartesia's ssm_cfg 'activation')."
            )
        if H % G or H * cfg.d_head != E:
            raise ConfigError(
                f"DiscreteMamba2: n_v_heads={H} value heads of {cfg.d_head} over d_inner={E} "
                f"with n_qk_heads={G}; expected n_v_heads * head dim == d_inner and n_qk_heads "
                "dividing n_v_heads."
            )
        self.conv_dim = E + 2 * G * N
        self.conv_offset = 0
        self.mup_vector = None
        self.in_proj = nn.Linear(cfg.d_model, self.conv_dim + E + H, bias=cfg.proj_bias)
        self.z_bias = None if cfg.proj_bias else nn.Parameter(torch.zeros(E))
        self.conv1d = self._depthwise_conv()
        self.D = nn.Parameter(torch.ones(H))
        self.out_proj = nn.Linear(E, cfg.d_model, bias=cfg.proj_bias)
        # A = -exp(A_log) = -1 for every head: a buffer, so that code reading A_log (the step,
        # the pattern, the scores) sees Llamba's fixed decay rate, and checkpoints need no entry.
        self.register_buffer("A_log", torch.zeros(H), persistent=False)
        self.register_buffer("head_group", torch.arange(H) // (H // G), persistent=False)
        self._add_hook_points()

    def split_projection(self, proj: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(z, xBC, a)`` of ``in_proj``'s output, stored as ``[xBC | z | a]``."""
        cfg = self.cfg
        xBC, z, a = proj.split([self.conv_dim, cfg.d_inner, cfg.n_heads], dim=-1)
        return z, xBC, a

    def gate_input(self, z: Tensor) -> Tensor:
        """``z + z_bias`` (``z`` when ``in_proj`` has a bias)."""
        return z if self.z_bias is None else z + self.z_bias

    def scan_values(self, x: Tensor, dt: Tensor) -> Tensor:
        """``x / dt``: the scan multiplies it by ``dt`` again, so ``dt`` only sets the decay."""
        return x / dt[..., None].to(x.dtype)

    def activate(self, conv: Tensor) -> Tensor:
        """``hook_conv`` (the convolution's output), then the configured activation."""
        out = self.hook_conv(conv)
        return torch.nn.functional.silu(out) if self.cfg.conv_activation == "silu" else out

    def gate_norm(self, y: Tensor, z: Tensor) -> Tensor:
        """``y * SiLU(gate)`` (no norm)."""
        return y * torch.nn.functional.silu(z)

    def step_size(self, dt_raw: Tensor) -> Tensor:
        """``dt = softplus(a)`` (no bias, no limits)."""
        return torch.nn.functional.softplus(dt_raw)
