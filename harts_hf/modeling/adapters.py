"""One declarative adapter per model family, registered by modeling-module name.

An adapter says which module-level kernel functions of the family's generated modeling module
take trees (and of which kind), which mixer / attention classes must still call them, which
attention-mask keys a tree call passes (hybrid models then build no mask), which layer kinds the
family may contain, and how its CausalLM post-processes logits. The mechanism lives in
``patch.py``; nothing here runs per token.

A declaration names the functions of one transformers release's modeling module; a family whose
modeling code changed between supported releases chains the earlier declaration as ``older``, and a
model takes the first one its module matches (:meth:`FamilyAdapter.layout`). Transformers 5.25 made
every hybrid mixer call replaceable kernel functions (``causal_conv1d_forward``,
``mamba2_scan_forward``, ``mamba_scan_forward``): the 5.25 declarations hook those, and the 5.23 ones,
derived from them through ``SUPERSEDED``, hook the functions the 5.23 mixers called directly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import ModuleType

import torch
from transformers import PreTrainedModel

from . import _compat
from .errors import UnsupportedModelError
from .kinds import KINDS

__all__ = ["ADAPTERS", "REFUSED", "FamilyAdapter", "adapter_for", "supported_families"]

HYBRID_MASKS = ("full_attention", "linear_attention")
SLIDING_MASKS = ("full_attention", "sliding_attention")
INTERFACE_CALL = "ALL_ATTENTION_FUNCTIONS.get_interface("


@dataclass(frozen=True)
class FamilyAdapter:
    """How one family takes trees.

    Args:
        family: the modeling module's name (``transformers.models.<family>.modeling_<family>``).
        kernels: module global -> kernel kind (``kinds.KINDS``) it is replaced by on tree calls.
        mixers: classes whose ``forward`` must call every kernel (checked in their source); their
            tree calls are named after them.
        mixer_forwards: class -> kind replacing its whole ``forward`` on tree calls, for mixers
            without a module-level kernel hook (and layers that drop the tree kwarg).
        attention: classes that must reach attention through ``ALL_ATTENTION_FUNCTIONS``.
        mask_keys: ``attention_mask`` dict keys of a tree call (None: a 4-D placeholder mask, for
            models whose forward does not take a dict).
        layer_kinds: values ``config.layer_types`` may hold.
        logits: the CausalLM's post-processing of ``lm_head`` output, ``(model, logits) -> logits``.
        aux_loss: the CausalLM computes the module's ``load_balancing_loss_func``.
        head_cast: the CausalLM casts the final hidden state to ``lm_head``'s dtype (the Mamba
            families, whose residual stream stays in fp32).
        release: the first transformers release whose modeling module this declaration matches.
        older: the family's declaration for the previous supported release, where its modeling
            code differs (None: this one matches every supported release).
    """

    family: str
    kernels: Mapping[str, str] = field(default_factory=dict)
    mixers: tuple[str, ...] = ()
    mixer_forwards: Mapping[str, str] = field(default_factory=dict)
    attention: tuple[str, ...] = ()
    mask_keys: tuple[str, ...] | None = HYBRID_MASKS
    layer_kinds: frozenset[str] = frozenset(HYBRID_MASKS)
    logits: Callable[[PreTrainedModel, torch.Tensor], torch.Tensor] | None = None
    aux_loss: bool = False
    head_cast: bool = False
    release: str = _compat.CHECKED_TRANSFORMERS[0]
    older: FamilyAdapter | None = None

    def layouts(self) -> list[FamilyAdapter]:
        """This declaration and its older ones, newest first."""
        return [self] + (self.older.layouts() if self.older is not None else [])

    def layout(self, module: ModuleType) -> FamilyAdapter:
        """The first declaration ``module`` matches, refusing a module that matches none."""
        problems = {}
        for layout in self.layouts():
            found = layout._problems(module)
            if not found:
                return layout
            problems[layout.release + ("+" if layout is self else "")] = found  # the newest stands for later ones
        found = "; ".join(f"declared for transformers {release}: " + "; ".join(p) for release, p in problems.items())
        raise UnsupportedModelError(
            f"the {self.family} modeling code does not match harts-hf's adapter ({found})" + _compat.version_advice()
        )

    def targets(self, module: ModuleType) -> list[tuple[ModuleType | type, str, str | None]]:
        """(owner, attribute, kernel kind) of every function the patch replaces; kind None: a mixer
        forward that only names its tree calls after its module (``calls.called_by``)."""
        return (
            [(module, name, kind) for name, kind in self.kernels.items()]
            + [(vars(module)[cls], "forward", kind) for cls, kind in self.mixer_forwards.items()]
            + [(vars(module)[cls], "forward", None) for cls in self.mixers]
        )

    def check(self, model: PreTrainedModel) -> None:
        """Refuse a model holding layer kinds this family's declaration does not cover."""
        kinds = set(getattr(model.config, "layer_types", None) or ()) - self.layer_kinds
        if kinds:
            raise UnsupportedModelError(
                f"the {self.family} model's layer kinds {sorted(kinds)} are not covered by harts-hf's adapter "
                f"(known: {sorted(self.layer_kinds)})"
            )

    def _problems(self, module: ModuleType) -> list[str]:
        """How ``module``'s internals differ from this declaration (empty: they match)."""
        missing = [
            name
            for name in (*self.kernels, *self.mixers, *self.mixer_forwards, *self.attention)
            if name not in vars(module)
        ]
        return [f"{module.__name__}.{name} is missing" for name in missing] or self._drift(module)

    def _drift(self, module: ModuleType) -> list[str]:
        problems = []
        for owner, name, kind in self.targets(module):
            if kind is None:
                continue
            fn = vars(owner)[name]
            where = f"{owner.__name__}.{name}"
            have = set(_compat.parameters(fn))
            lost = [p for p in KINDS[kind].params if not have & set((p,) if isinstance(p, str) else p)]
            if lost:
                problems.append(f"{where} lost parameters {lost}")
            problems += _markers_gone(where, fn, KINDS[kind].source_markers)
            for other, markers in KINDS[kind].restates.items():
                at = f"{module.__name__}.{other}"
                if other not in vars(module):
                    problems.append(f"{at} is missing")
                else:
                    problems += _markers_gone(at, vars(module)[other], markers)
        sources = [_compat.forward_source(vars(module)[c]) for c in self.mixers]
        problems += [
            f"no mixer forward calls {name}" for name in self.kernels if not any(f"{name}(" in s for s in sources)
        ]
        problems += [
            f"{cls}.forward no longer calls {INTERFACE_CALL}...)"
            for cls in self.attention
            if INTERFACE_CALL not in _compat.forward_source(vars(module)[cls])
        ]
        return problems


def _markers_gone(where: str, fn: Callable, markers: tuple[str, ...]) -> list[str]:
    gone = [m for m in markers if m not in _compat.source(fn)]
    return [f"{where} no longer contains {gone}"] if gone else []


def _gemma_softcap(model: PreTrainedModel, logits: torch.Tensor) -> torch.Tensor:
    cap = model.config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _granite_scaling(model: PreTrainedModel, logits: torch.Tensor) -> torch.Tensor:
    return logits / model.config.logits_scaling


def _falcon_multiplier(model: PreTrainedModel, logits: torch.Tensor) -> torch.Tensor:
    return logits * model.model.lm_head_multiplier


CONV = {"causal_conv1d_forward": "conv_forward"}
GDN = {**CONV, "torch_chunk_gated_delta_rule": "gated_delta"}
KDA = {**CONV, "chunk_kimi_delta_attention": "kda"}
CONV_LAYERS = {"mask_keys": ("full_attention", "conv"), "layer_kinds": frozenset({"full_attention", "conv"})}
MAMBA2 = {
    **CONV,
    "mamba2_scan_forward": "mamba2_scan_forward",
    "mamba2_split_conv1d_scan_combined": "mamba2_fused",
}
MAMBA_V1 = {**CONV, "mamba_scan_forward": "mamba_scan_forward"}

SUPERSEDED: dict[str, tuple[str, str]] = {
    "causal_conv1d_forward": ("causal_conv1d_fn", "conv"),
    "mamba2_scan_forward": ("mamba2_chunk_scan", "mamba2_scan"),
}
"""transformers 5.25's kernel seams -> the function (and kind) the 5.23 mixers called in their place."""

SEAMS_RELEASE = "5.25"  # the release whose mixers call the seams


def _before_seams(adapter: FamilyAdapter, **changes) -> FamilyAdapter:
    """``adapter`` (a 5.25 declaration) as the family's 5.23 modeling module has it: every seam
    replaced by the function it superseded, and ``changes``."""
    changes.setdefault("kernels", dict(SUPERSEDED.get(name, (name, kind)) for name, kind in adapter.kernels.items()))
    return replace(adapter, release=_compat.CHECKED_TRANSFORMERS[0], older=None, **changes)


def _hybrid(
    family: str, prefix: str, kernels: Mapping[str, str], mixer: str, *, new: bool = False, **kwargs
) -> FamilyAdapter:
    """A hybrid family's 5.25 declaration and, unless it is ``new`` in 5.25, its 5.23 one."""
    kwargs.setdefault("attention", (prefix + "Attention",))
    adapter = FamilyAdapter(family, kernels, mixers=(prefix + mixer,), release=SEAMS_RELEASE, **kwargs)
    return adapter if new else replace(adapter, older=_before_seams(adapter))


def _mamba_v1(
    family: str, prefix: str, mixer: str, fused: str | None = None, forwards: Mapping[str, str] | None = None, **kwargs
) -> FamilyAdapter:
    """A Mamba v1 mixer (``mixer``: its 5.23 kind). Under 5.25 its conv and selective scan are seams;
    under 5.23 its scan gets no kwargs, so the whole mixer ``forward`` is re-stated. ``fused``: the
    kind re-stating, under 5.25 too, a mixer whose training path may take a fused kernel that gets no
    kwargs. ``forwards``: layers that drop the kwargs, re-stated to hand the tree down."""
    name, forwards = f"{prefix}Mixer", dict(forwards or {})
    if fused is None:
        new = FamilyAdapter(family, MAMBA_V1, mixers=(name,), mixer_forwards=forwards, release=SEAMS_RELEASE, **kwargs)
    else:
        new = FamilyAdapter(family, mixer_forwards={name: fused, **forwards}, release=SEAMS_RELEASE, **kwargs)
    return replace(new, older=_before_seams(new, kernels={}, mixers=(), mixer_forwards={name: mixer, **forwards}))


def _pure_mamba_v1(family: str, prefix: str, mixer: str, **kwargs) -> FamilyAdapter:
    """A pure Mamba v1 model: its model and block forwards drop the kwargs, so both are re-stated
    to hand the tree to the mixer; no attention, no mask (the model builds none)."""
    forwards = {f"{prefix}Block": "mamba_block", f"{prefix}Model": "mamba_model"}
    return _mamba_v1(family, prefix, mixer, forwards=forwards, mask_keys=None, head_cast=True, **kwargs)


def _dense(family: str, prefix: str, **kwargs) -> FamilyAdapter:
    kwargs.setdefault("mask_keys", None)
    kwargs.setdefault("layer_kinds", frozenset({"full_attention"}))
    return FamilyAdapter(family, attention=(prefix + "Attention",), **kwargs)


ADAPTERS: dict[str, FamilyAdapter] = {
    a.family: a
    for a in (
        _hybrid("qwen3_5", "Qwen3_5", GDN, "GatedDeltaNet"),
        _hybrid("qwen3_5_moe", "Qwen3_5Moe", GDN, "GatedDeltaNet", aux_loss=True),
        _hybrid("qwen3_next", "Qwen3Next", GDN, "GatedDeltaNet", aux_loss=True),
        _hybrid("olmo_hybrid", "OlmoHybrid", GDN, "GatedDeltaNet"),
        _hybrid(
            "lara_mini",
            "LaraMini",
            GDN,
            "GatedDeltaNet",
            new=True,
            aux_loss=True,
            mask_keys=("full_attention", "sliding_attention", "linear_attention"),
            layer_kinds=frozenset({"full_attention", "sliding_attention", "linear_attention"}),
        ),
        _hybrid("kimi_linear", "KimiLinear", KDA, "DeltaAttention"),
        _hybrid("bailing_hybrid", "BailingHybrid", KDA, "DeltaAttention"),
        _hybrid("lfm2", "Lfm2", CONV, "ShortConv", **CONV_LAYERS),
        _hybrid("lfm2_moe", "Lfm2Moe", CONV, "ShortConv", **CONV_LAYERS),
        _hybrid(
            "lfm3",
            "Lfm3",
            CONV,
            "ShortConv",
            mask_keys=("full_attention", "sliding_attention", "conv"),
            layer_kinds=frozenset({"full_attention", "sliding_attention", "conv"}),
        ),
        _hybrid(
            "nemotron_h",
            "NemotronH",
            MAMBA2,
            "Mamba2Mixer",
            layer_kinds=frozenset({"full_attention", "linear_attention", "mlp", "moe"}),
        ),
        _hybrid("falcon_h1", "FalconH1", MAMBA2, "Mixer", layer_kinds=frozenset({"hybrid"}), logits=_falcon_multiplier),
        _hybrid("granitemoehybrid", "GraniteMoeHybrid", MAMBA2, "MambaLayer", logits=_granite_scaling, aux_loss=True),
        _hybrid("bamba", "Bamba", MAMBA2, "Mixer"),
        _hybrid("zamba2", "Zamba2", MAMBA2, "MambaMixer", layer_kinds=frozenset({"hybrid", "linear_attention"})),
        _hybrid("mamba2", "Mamba2", MAMBA2, "Mixer", attention=(), mask_keys=None, head_cast=True),
        _pure_mamba_v1("mamba", "Mamba", "mamba_mixer", fused="fused_mamba_mixer"),
        _pure_mamba_v1("falcon_mamba", "FalconMamba", "normed_mamba_mixer"),
        FamilyAdapter(
            "minimax",
            mixer_forwards={"MiniMaxLightningAttention": "lightning_mixer"},
            attention=("MiniMaxAttention",),
            aux_loss=True,
        ),
        _mamba_v1(
            "jamba",
            "JambaMamba",
            "normed_mamba_mixer",
            forwards={"JambaMambaDecoderLayer": "jamba_mamba_layer"},
            attention=("JambaAttention",),
            aux_loss=True,
        ),
        _dense("llama", "Llama"),
        _dense("mistral", "Mistral"),
        _dense("qwen2", "Qwen2", mask_keys=SLIDING_MASKS, layer_kinds=frozenset(SLIDING_MASKS)),
        _dense("qwen3", "Qwen3", mask_keys=SLIDING_MASKS, layer_kinds=frozenset(SLIDING_MASKS)),
        _dense("qwen3_moe", "Qwen3Moe", aux_loss=True),
        _dense(
            "gemma2", "Gemma2", mask_keys=SLIDING_MASKS, layer_kinds=frozenset(SLIDING_MASKS), logits=_gemma_softcap
        ),
        _dense(
            "gemma3", "Gemma3", mask_keys=SLIDING_MASKS, layer_kinds=frozenset(SLIDING_MASKS), logits=_gemma_softcap
        ),
    )
}

_INDEXED = (
    "{}: a learned indexer picks each query's top-k keys; harts-hf has no tree kernel for indexed (sparse top-k) "
    "attention"
)
_NO_KERNEL = "its {} has no tree kernel in harts-hf"
_VISION = "a vision-language model: harts-hf takes the {} text model (load the language model as {})"

# Known families harts-hf does not take: named in the refusal so users know why (the families of
# transformers whose layers hold anything but plain attention; tests check each still exists).
REFUSED: dict[str, str] = {
    "kolibri1_1": _INDEXED.format("sparse (indexed) attention"),
    "hy_v4_vl": _INDEXED.format("a vision-language model with DeepSeek sparse attention"),
    "inkling2_loop": _NO_KERNEL.format(
        "dynamic (input-dependent) short convolution, block attention residuals and looped depth"
    ),
    "zamba": "its multi-head Mamba (v1) mixer (per-head x/dt projections and B/C, one selective scan per "
    "head, which gets no forward kwargs) is not re-stated for trees in harts-hf",
    "qwen4_exp": _INDEXED.format("Gated DeltaNet with indexed attention (QSA)"),
    "glm5_next": _INDEXED.format("KDA with indexed attention and hyper-connections"),
    **{
        family: _INDEXED.format("DeepSeek sparse attention")
        for family in ("deepseek_v32", "deepseek_v4", "glm_moe_dsa", "mistral_large4", "axk2", "dots3_note", "hy_v4")
    },
    "minimax_m3_vl": _INDEXED.format("a vision-language model with sparse attention"),
    "inkling": _NO_KERNEL.format("short convolutions over keys, values and the residual stream"),
    "inkling2": _NO_KERNEL.format("dynamic (input-dependent) short convolution and block attention residuals"),
    "recurrent_gemma": _NO_KERNEL.format("RG-LRU recurrence (Griffin)"),
    "rwkv": _NO_KERNEL.format("WKV time mix (RWKV-4)"),
    "xlstm": _NO_KERNEL.format("mLSTM cell"),
    "zaya": _NO_KERNEL.format("compressed convolutional attention (CCA: convolutions over q/k before attention)"),
    "lfm2_vl": _VISION.format("LFM2", "Lfm2ForCausalLM"),
    "lfm3_vl": _VISION.format("LFM3", "Lfm3ForCausalLM"),
}


def supported_families() -> list[str]:
    return sorted(ADAPTERS)


def adapter_for(model: PreTrainedModel) -> FamilyAdapter:
    """The adapter of ``model``'s family; refuses other families and non-causal-LM classes."""
    family = _compat.family_name(model)
    if family in REFUSED:
        raise UnsupportedModelError(
            f"{type(model).__name__}: the {family} family is not supported ({REFUSED[family]}); "
            f"supported families: {supported_families()}"
        )
    if family not in ADAPTERS:
        raise UnsupportedModelError(
            f"{type(model).__name__} (family {family!r}) is not supported by harts-hf; "
            f"supported families: {supported_families()}"
        )
    name = _compat.model_class(model).__name__
    if not name.endswith(("ForCausalLM", "Model")):
        raise UnsupportedModelError(
            f"{name}: harts-hf patches causal LMs and their base models (*ForCausalLM / *Model) only"
        )
    return ADAPTERS[family]
