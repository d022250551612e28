"""Model families as the project builds them: randomly initialised causal LMs, offline, from config classes.

Every family is one declaration (:class:`Family`, in :data:`FAMILIES`): its transformers config /
model classes, its tiny test model's config keywords, and for bench models the config keywords
that give it a :class:`ModelSize` and the :func:`Arch` numbers (layer counts and mixer dimensions)
the analytic FLOP count needs. Hybrids follow a 3 : 1 pattern of linear (or SSM / conv) mixers
to full-attention layers, like Qwen3.5, Kimi-Linear and Nemotron-H.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers as tf

from ..chunking import CHUNK_SIZE
from ..modeling import _compat

__all__ = [
    "BENCH_FAMILIES",
    "FAMILIES",
    "SIZES",
    "TINY_EXPERTS",
    "TINY_SHARED",
    "TINY_VOCAB",
    "Arch",
    "BenchModel",
    "Family",
    "ModelSize",
    "build_model",
    "installed",
]


@dataclass(frozen=True)
class ModelSize:
    """Shared size knobs; each family maps them onto its own config keywords.

    Args:
        hidden, intermediate: model width and dense MLP width.
        groups: repeats of the family's layer pattern (3 mixers + 1 attention for hybrids).
        heads, kv_heads, head_dim: full attention.
        linear_heads, linear_head_dim: linear-attention / SSM heads (value heads for GDN).
        experts, top_k, expert_intermediate: MoE layers of MoE families.
        vocab: vocabulary size (the workload draws token ids below it).
    """

    hidden: int
    intermediate: int
    groups: int
    heads: int
    kv_heads: int
    head_dim: int
    linear_heads: int
    linear_head_dim: int
    experts: int
    top_k: int
    expert_intermediate: int
    vocab: int

    @property
    def layers(self) -> int:
        return 4 * self.groups


# default: the benchmark's model, sized for a 2-core CPU (a step of the default workload in ~5-20 s)
# with Qwen3.5's proportions at scale: token-wise work ~96% of the FLOPs, linear mixers ~3%.
# quick: CI's smoke run. tiny: unit tests (hidden 32, vocab 128).
SIZES: dict[str, ModelSize] = {
    "default": ModelSize(
        hidden=256,
        intermediate=768,
        groups=1,
        heads=4,
        kv_heads=2,
        head_dim=64,
        linear_heads=4,
        linear_head_dim=32,
        experts=8,
        top_k=2,
        expert_intermediate=256,
        vocab=8192,
    ),
    # gpu: a step sized for one H100/H200 (bf16): Qwen3.5's head shapes, 8 layers.
    "gpu": ModelSize(
        hidden=1024,
        intermediate=3072,
        groups=2,
        heads=8,
        kv_heads=2,
        head_dim=128,
        linear_heads=8,
        linear_head_dim=128,
        experts=16,
        top_k=4,
        expert_intermediate=512,
        vocab=32768,
    ),
    "quick": ModelSize(
        hidden=64,
        intermediate=192,
        groups=1,
        heads=4,
        kv_heads=2,
        head_dim=16,
        linear_heads=4,
        linear_head_dim=16,
        experts=4,
        top_k=2,
        expert_intermediate=64,
        vocab=1024,
    ),
    "tiny": ModelSize(
        hidden=32,
        intermediate=48,
        groups=1,
        heads=4,
        kv_heads=2,
        head_dim=8,
        linear_heads=2,
        linear_head_dim=8,
        experts=4,
        top_k=2,
        expert_intermediate=16,
        vocab=128,
    ),
}


@dataclass(frozen=True)
class Arch:
    """What the analytic FLOP count needs beyond the parameter shapes.

    Args:
        attention_layers, attention_heads, qk_dim, v_dim: full-attention layers and their heads.
        linear_kind: "delta" (GDN, KDA), "ssd" (Mamba2), "scan" (Mamba v1's selective scan: one state of
            ``key_dim`` per channel, ``linear_heads`` channels) or None (conv-only or dense families).
        linear_layers, linear_heads, key_dim, value_dim, chunk: the linear mixers (SSD: key_dim
            is the state size, value_dim the head dim).
        experts, top_k: routed experts (0 for dense MLPs).
    """

    attention_layers: int
    attention_heads: int
    qk_dim: int
    v_dim: int
    linear_kind: str | None = None
    linear_layers: int = 0
    linear_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    chunk: int = CHUNK_SIZE
    experts: int = 0
    top_k: int = 0


@dataclass(frozen=True)
class Family:
    """One model family as the project builds it; the bench, the tests' tiny models and the TRL
    suites' stand-ins all read this declaration (the adapter that patches it is the library's,
    ``harts_hf.modeling.adapters.ADAPTERS``, under the same name).

    Args:
        config, model: the transformers config and causal-LM class names.
        tiny: config keywords beyond :data:`TINY_SHARED` of the tests' tiny model (every layer kind of
            the family in 2-4 layers).
        sized: the config keywords that give it a :class:`ModelSize` (None: not a bench model).
        arch: the :class:`Arch` numbers the analytic FLOP count reads from its config.
    """

    config: str
    model: str
    tiny: dict
    sized: Callable[[ModelSize], dict] | None = None
    arch: Callable[[tf.PretrainedConfig], Arch] | None = None


def _hybrid_types(s: ModelSize, mixer: str = "linear_attention", attention: str = "full_attention") -> list[str]:
    return [mixer, mixer, mixer, attention] * s.groups


def _attn(s: ModelSize) -> dict:
    return dict(num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim)


def _gdn(s: ModelSize) -> dict:
    return dict(
        **_attn(s),
        layer_types=_hybrid_types(s),
        linear_num_key_heads=max(1, s.linear_heads // 2),
        linear_num_value_heads=s.linear_heads,
        linear_key_head_dim=s.linear_head_dim,
        linear_value_head_dim=s.linear_head_dim,
        linear_conv_kernel_dim=4,
    )


def _moe(s: ModelSize) -> dict:
    return dict(num_experts=s.experts, num_experts_per_tok=s.top_k, moe_intermediate_size=s.expert_intermediate)


def _gdn_moe(s: ModelSize) -> dict:
    return dict(**_gdn(s), **_moe(s), shared_expert_intermediate_size=s.expert_intermediate)


def _conv_hybrid(s: ModelSize) -> dict:
    return dict(**_attn(s), layer_types=_hybrid_types(s, "conv"))


def _mla(s: ModelSize) -> dict:
    return dict(
        num_attention_heads=s.heads,
        num_key_value_heads=s.heads,
        kv_lora_rank=s.hidden // 4,
        qk_rope_head_dim=s.head_dim // 2,
        qk_nope_head_dim=s.head_dim // 2,
        v_head_dim=s.head_dim,
    )


def _kimi(s: ModelSize) -> dict:
    return dict(
        **_mla(s),
        layer_types=_hybrid_types(s),
        mlp_layer_types=["dense"] + ["sparse"] * (s.layers - 1),
        linear_num_heads=s.linear_heads,
        linear_head_dim=s.linear_head_dim,
        linear_conv_kernel_dim=4,
        num_local_experts=s.experts,
        num_experts_per_tok=s.top_k,
        moe_intermediate_size=s.expert_intermediate,
    )


def _bailing(s: ModelSize) -> dict:
    return dict(
        **_kimi(s),
        head_dim=s.head_dim,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        layer_group_size=4,
    )


def _nemotron(s: ModelSize) -> dict:
    # Nemotron-H blocks are single sublayers: a mixer or attention block, then an MoE block.
    blocks = ["mamba", "moe", "mamba", "moe", "mamba", "moe", "attention", "moe"] * s.groups
    return dict(
        **_attn(s),
        layers_block_type=blocks,
        mamba_num_heads=s.linear_heads,
        mamba_head_dim=s.linear_head_dim,
        n_groups=1,
        ssm_state_size=s.linear_head_dim,
        conv_kernel=4,
        chunk_size=64,
        n_routed_experts=s.experts,
        num_experts_per_tok=s.top_k,
        moe_intermediate_size=s.expert_intermediate,
        moe_shared_expert_intermediate_size=s.expert_intermediate,
    )


def _mamba2(s: ModelSize) -> dict:
    # Mamba2's mixers are 2 x hidden wide: the heads follow from the head dim
    return dict(
        num_heads=2 * s.hidden // s.linear_head_dim,
        head_dim=s.linear_head_dim,
        n_groups=1,
        state_size=s.linear_head_dim,
        conv_kernel=4,
        chunk_size=64,
    )


def _mamba(s: ModelSize) -> dict:
    # Mamba v1: one mixer per layer, ``intermediate`` channels each with its own state
    return dict(state_size=s.linear_head_dim, conv_kernel=4, time_step_rank=max(1, s.hidden // 16))


def _count(config: tf.PretrainedConfig, kind: str) -> int:
    return list(config.layer_types).count(kind)


def _gdn_arch(c: tf.PretrainedConfig, experts: int = 0, top_k: int = 0) -> Arch:
    return Arch(
        _count(c, "full_attention"),
        c.num_attention_heads,
        c.head_dim,
        c.head_dim,
        "delta",
        _count(c, "linear_attention"),
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
        64,
        experts,
        top_k,
    )


def _gdn_moe_arch(c: tf.PretrainedConfig) -> Arch:
    return _gdn_arch(c, c.num_experts, c.num_experts_per_tok)


def _kda_arch(c: tf.PretrainedConfig) -> Arch:
    return Arch(
        _count(c, "full_attention"),
        c.num_attention_heads,
        c.qk_nope_head_dim + c.qk_rope_head_dim,
        c.v_head_dim,
        "delta",
        _count(c, "linear_attention"),
        c.linear_num_heads,
        c.linear_head_dim,
        c.linear_head_dim,
        64,
        c.num_local_experts,
        c.num_experts_per_tok,
    )


def _nemotron_arch(c: tf.PretrainedConfig) -> Arch:
    return Arch(
        _count(c, "full_attention"),
        c.num_attention_heads,
        c.head_dim,
        c.head_dim,
        "ssd",
        _count(c, "linear_attention"),
        c.mamba_num_heads,
        c.ssm_state_size,
        c.mamba_head_dim,
        c.chunk_size,
        c.n_routed_experts,
        c.num_experts_per_tok,
    )


def _mamba2_arch(c: tf.PretrainedConfig) -> Arch:
    return Arch(0, 0, 0, 0, "ssd", _count(c, "linear_attention"), c.num_heads, c.state_size, c.head_dim, c.chunk_size)


def _mamba_arch(c: tf.PretrainedConfig) -> Arch:
    return Arch(0, 0, 0, 0, "scan", c.num_hidden_layers, c.intermediate_size, c.state_size)


def _dense_arch(c: tf.PretrainedConfig) -> Arch:
    return Arch(c.num_hidden_layers, c.num_attention_heads, c.head_dim, c.head_dim)


def _lfm2_arch(c: tf.PretrainedConfig) -> Arch:
    return Arch(_count(c, "full_attention"), c.num_attention_heads, c.head_dim, c.head_dim)


# ---------------------------------------------------------------- the tests' tiny models
TINY_VOCAB = 128
_TINY_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_TINY_GDN = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
_TINY_HYBRID = ["linear_attention", "full_attention", "linear_attention"]
_TINY_SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]
_TINY_MLA = dict(
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
)
TINY_EXPERTS = 4
_TINY_MOE = dict(num_experts=TINY_EXPERTS, num_experts_per_tok=2, moe_intermediate_size=16)
_TINY_MAMBA_V1 = dict(state_size=8, conv_kernel=4, time_step_rank=4)  # 48 channels (the shared intermediate size)
_TINY_MAMBA = dict(
    mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16
)

FAMILIES: dict[str, Family] = {
    "qwen3_5": Family(
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(**_TINY_ATTN, **_TINY_GDN, layer_types=_TINY_HYBRID),
        sized=_gdn,
        arch=_gdn_arch,
    ),
    "qwen3_5_moe": Family(
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(**_TINY_ATTN, **_TINY_GDN, **_TINY_MOE, shared_expert_intermediate_size=16, layer_types=_TINY_HYBRID),
        sized=_gdn_moe,
        arch=_gdn_moe_arch,
    ),
    "qwen3_next": Family(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(**_TINY_ATTN, **_TINY_GDN, **_TINY_MOE, shared_expert_intermediate_size=16, layer_types=_TINY_HYBRID),
        sized=_gdn_moe,
        arch=_gdn_moe_arch,
    ),
    "olmo_hybrid": Family(
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        dict(**_TINY_ATTN, **_TINY_GDN, layer_types=_TINY_HYBRID),
        sized=_gdn,
        arch=_gdn_arch,
    ),
    "lara_mini": Family(  # transformers 5.25+: GDN, sliding and NoPE full attention, MoE
        "LaraMiniConfig",
        "LaraMiniForCausalLM",
        dict(
            **_TINY_ATTN,
            **_TINY_GDN,
            **_TINY_MOE,
            shared_expert_intermediate_size=16,
            sliding_window=24,
            layer_types=["linear_attention", "sliding_attention", "full_attention", "linear_attention"],
        ),
        sized=_gdn_moe,  # as lfm3's: full attention only (the FLOP count has no sliding-window term)
        arch=_gdn_moe_arch,
    ),
    "kimi_linear": Family(
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(
            **_TINY_MLA,
            linear_num_heads=2,
            linear_head_dim=8,
            linear_conv_kernel_dim=4,
            num_local_experts=TINY_EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            layer_types=_TINY_HYBRID,
            mlp_layer_types=["dense", "sparse", "sparse"],
        ),
        sized=_kimi,
        arch=_kda_arch,
    ),
    "bailing_hybrid": Family(
        "BailingHybridConfig",
        "BailingHybridForCausalLM",
        dict(
            **_TINY_MLA,
            head_dim=8,
            num_local_experts=TINY_EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            layer_group_size=3,
            layer_types=_TINY_HYBRID,
            mlp_layer_types=["dense", "sparse", "sparse"],
        ),
        sized=_bailing,
        arch=_kda_arch,
    ),
    "lfm2": Family(
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(**_TINY_ATTN, layer_types=["conv", "full_attention", "conv"]),
        sized=_conv_hybrid,
        arch=_lfm2_arch,
    ),
    "lfm3": Family(
        "Lfm3Config",
        "Lfm3ForCausalLM",
        dict(**_TINY_ATTN, sliding_window=24, layer_types=["conv", "sliding_attention", "full_attention", "conv"]),
        sized=_conv_hybrid,
        arch=_lfm2_arch,
    ),
    "lfm2_moe": Family(
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(**_TINY_ATTN, **_TINY_MOE, num_dense_layers=1, layer_types=["conv", "full_attention", "conv"]),
    ),
    "nemotron_h": Family(
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            **_TINY_ATTN,
            mamba_num_heads=4,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=8,
            conv_kernel=4,
            chunk_size=16,
            n_routed_experts=TINY_EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
            layers_block_type=["mamba", "attention", "moe", "mlp"],
        ),
        sized=_nemotron,
        arch=_nemotron_arch,
    ),
    "falcon_h1": Family(
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(**_TINY_ATTN, **_TINY_MAMBA, mamba_d_ssm=64, lm_head_multiplier=0.5),
    ),
    "granitemoehybrid": Family(
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            **_TINY_MAMBA,
            num_local_experts=TINY_EXPERTS,
            num_experts_per_tok=2,
            shared_intermediate_size=16,
            logits_scaling=2.0,
            position_embedding_type="rope",
            layer_types=["mamba", "attention", "mamba"],
        ),
    ),
    "bamba": Family(
        "BambaConfig",
        "BambaForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, **_TINY_MAMBA, attn_layer_indices=[1]),
    ),
    "zamba2": Family(
        "Zamba2Config",
        "Zamba2ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_ngroups=2,
            n_mamba_heads=4,
            chunk_size=16,
            layers_block_type=["mamba", "hybrid", "mamba"],
        ),
    ),
    "mamba2": Family(
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(num_heads=8, head_dim=8, n_groups=2, state_size=8, conv_kernel=4, chunk_size=16),
        sized=_mamba2,
        arch=_mamba2_arch,
    ),
    "mamba": Family("MambaConfig", "MambaForCausalLM", _TINY_MAMBA_V1, sized=_mamba, arch=_mamba_arch),
    "falcon_mamba": Family(
        "FalconMambaConfig", "FalconMambaForCausalLM", _TINY_MAMBA_V1, sized=_mamba, arch=_mamba_arch
    ),
    "minimax": Family(
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        dict(
            **_TINY_ATTN, num_local_experts=TINY_EXPERTS, num_experts_per_tok=2, block_size=16, layer_types=_TINY_HYBRID
        ),
    ),
    "jamba": Family(
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=TINY_EXPERTS,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_dt_rank=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=0,
        ),
    ),
    "llama": Family("LlamaConfig", "LlamaForCausalLM", dict(**_TINY_ATTN), sized=_attn, arch=_dense_arch),
    "mistral": Family("MistralConfig", "MistralForCausalLM", dict(**_TINY_ATTN, sliding_window=None)),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", dict(**_TINY_ATTN)),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(**_TINY_ATTN)),
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(**_TINY_ATTN, **_TINY_MOE)),
    "gemma2": Family(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            **_TINY_ATTN,
            sliding_window=24,
            final_logit_softcapping=5.0,
            attn_logit_softcapping=4.0,
            layer_types=_TINY_SLIDING,
        ),
    ),
    "gemma3": Family(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(**_TINY_ATTN, sliding_window=24, final_logit_softcapping=5.0, layer_types=_TINY_SLIDING),
    ),
}

TINY_SHARED = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    initializer_range=0.1,
)


def installed(spec: Family) -> bool:
    """Whether the installed transformers has the family's classes (lara_mini came in 5.25)."""
    return hasattr(tf, spec.config)


BENCH_FAMILIES: dict[str, Family] = {name: f for name, f in FAMILIES.items() if f.sized is not None and installed(f)}
"""The families the bench builds at every :data:`SIZES` entry with the installed transformers
(lara_mini needs 5.25; the bench's lfm3 and lara_mini hold full attention only: the FLOP count
has no sliding-window term)."""


@dataclass
class BenchModel:
    """A benchmark model and the numbers its FLOP count needs."""

    family: str
    model: tf.PreTrainedModel
    arch: Arch


def build_model(
    family: str,
    size: ModelSize | str = "default",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_positions: int = 32768,
    attn: str = "sdpa",
) -> BenchModel:
    """A freshly initialised ``family`` causal LM of ``size`` (eval mode: no dropout
    nor router noise, so every mode sees the same function),
    reproducible from ``seed``."""
    if family not in BENCH_FAMILIES:
        newer = (
            f" ({FAMILIES[family].config} is not in transformers {tf.__version__}: install 5.25)"
            if family in FAMILIES and FAMILIES[family].sized
            else ""
        )
        raise ValueError(
            f"unknown bench model family {family!r}{newer}; choose one of {', '.join(sorted(BENCH_FAMILIES))}"
        )
    if isinstance(size, str):
        if size not in SIZES:
            raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(sorted(SIZES))}")
        size = SIZES[size]
    spec = BENCH_FAMILIES[family]
    kwargs = dict(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    kwargs.update(spec.sized(size))
    for key in ("layer_types", "layers_block_type"):
        if key in kwargs:
            kwargs["num_hidden_layers"] = len(kwargs[key])
    config = getattr(tf, spec.config)(**kwargs)
    cls = getattr(tf, spec.model)
    # a family without sdpa (Mamba2: no attention at all) takes "eager"
    _compat.set_attention_name(config, attn if cls._supports_sdpa or attn != "sdpa" else "eager")
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    return BenchModel(family, model.eval(), spec.arch(config))
