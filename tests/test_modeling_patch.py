"""patch_model: refusals, idempotence, reversibility, and calls without a tree left untouched."""

from __future__ import annotations

import copy
import gc
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from packaging.version import Version
from tiny_models import FAMILIES, VOCAB, family_forest, tiny_model

from harts_hf.forest import RolloutForest
from harts_hf.modeling import (
    UnsupportedModelError,
    _compat,
    from_pretrained,
    is_patched,
    patch_model,
    supported_families,
    tree_logprobs,
    unpatch_model,
)
from harts_hf.modeling.adapters import ADAPTERS, REFUSED
from harts_hf.modeling.attention import tree_attention_name
from harts_hf.modeling.kinds import KINDS

GDN_MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"


def _no_tree_outputs(model: tf.PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a right-padded batch with a mask, and 4 greedy tokens generated with the cache."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 70), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 50:] = 0
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        tokens = model.generate(ids[:1, :20], max_new_tokens=4, do_sample=False, pad_token_id=0)
    return logits, tokens


@pytest.mark.parametrize("family", list(FAMILIES))
def test_calls_without_a_tree_are_unchanged(family):
    """The patched model and an unpatched instance of the same family (whose module kernels are
    now wrapped) return bit-identical logits and generations, in eval and train mode."""
    model, other = tiny_model(family), tiny_model(family, seed=1)
    before, other_before = _no_tree_outputs(model), _no_tree_outputs(other)
    patch_model(model)
    assert model.config._attn_implementation.startswith("harts_")
    for got, want in zip(_no_tree_outputs(model) + _no_tree_outputs(other), before + other_before):
        assert torch.equal(got, want)
    model.train()
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    train_logits = model(input_ids=ids).logits
    unpatch_model(model)
    assert torch.equal(model(input_ids=ids).logits, train_logits)


def test_patch_is_idempotent_and_reversible():
    gc.collect()  # patched models of other tests keep the family's kernels wrapped while alive
    model = tiny_model("qwen3_5")
    module = sys.modules[GDN_MODULE]
    names = tuple(ADAPTERS["qwen3_5"].layout(module).kernels)  # the installed release's hooks
    unpatch_model(patch_model(model))
    originals = {n: vars(module)[n] for n in names}
    assert patch_model(model) is model
    wrapped = {n: vars(module)[n] for n in names}
    assert all(wrapped[n] is not originals[n] for n in names)
    patch_model(model)
    assert all(vars(module)[n] is wrapped[n] for n in names)
    assert model.config._attn_implementation == "harts_sdpa" and is_patched(model)
    unpatch_model(model)
    assert model.config._attn_implementation == "sdpa" and not is_patched(model)
    assert all(vars(module)[n] is originals[n] for n in names)


def test_kernels_stay_wrapped_while_another_model_of_the_family_is_patched():
    first, second = patch_model(tiny_model("qwen3_5")), patch_model(tiny_model("qwen3_5", seed=1))
    unpatch_model(first)
    forest = RolloutForest.from_sequences(family_forest(np.random.default_rng(0), small=True))
    assert tree_logprobs(second, forest).shape == (forest.num_trajectories, forest.max_length - 1)
    unpatch_model(second)
    with pytest.raises(UnsupportedModelError, match="not patched"):
        tree_logprobs(second, forest)


def test_deep_copy_stays_patched():
    """TRL builds its reference model as a deep copy of the policy."""
    model = patch_model(tiny_model("qwen3_5"))
    forest = RolloutForest.from_sequences(family_forest(np.random.default_rng(0), small=True))
    with torch.no_grad():
        assert torch.equal(tree_logprobs(copy.deepcopy(model), forest), tree_logprobs(model, forest))


def test_tree_calls_refuse_a_model_whose_patch_is_gone():
    forest = RolloutForest.from_sequences([[3, 4, 5]])
    model = tiny_model("llama")
    with pytest.raises(UnsupportedModelError, match="patch_model"):
        tree_logprobs(model, forest)
    patch_model(model)
    model.set_attn_implementation("sdpa")
    with pytest.raises(UnsupportedModelError, match="switched its attention"):
        tree_logprobs(model, forest)
    patch_model(model)
    assert tree_logprobs(model, forest).shape == (1, 2)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2), id="gpt2"),
        pytest.param(
            tf.ZambaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=4,
                num_attention_heads=2,
                num_key_value_heads=2,
                n_mamba_heads=2,
                mamba_d_state=4,
                mamba_dt_rank=4,
                attn_layer_period=1,
                attn_layer_offset=0,
            ),
            id="zamba",
        ),
        pytest.param(
            tf.RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32), id="rwkv"
        ),
        pytest.param(
            tf.RecurrentGemmaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=2,
                lru_width=32,
                block_types=["recurrent", "attention"],
            ),
            id="recurrent_gemma",
        ),
    ],
)
def test_unsupported_families_are_refused(config):
    model = tf.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError) as err:
        patch_model(model)
    assert str(supported_families()) in str(err.value)
    assert REFUSED.get(config.model_type, "is not supported by harts-hf") in str(err.value)
    assert not is_patched(model)


def test_every_refused_family_is_one_of_transformers():
    """The refusal list names modules of the installed transformers (a renamed one would never match)."""
    models = Path(tf.__file__).parent / "models"
    newer = {"kolibri1_1", "hy_v4_vl", "inkling2_loop"}  # transformers 5.25's
    missing = [f for f in REFUSED if not (models / f / f"modeling_{f}.py").exists()]
    assert missing == [] if Version(tf.__version__) >= Version("5.25") else set(missing) <= newer, missing
    assert not set(REFUSED) & set(supported_families())


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda m, mp: mp.delattr(m, "torch_chunk_gated_delta_rule"), id="kernel_removed"),
        pytest.param(
            lambda m, mp: mp.setattr(m, "torch_chunk_gated_delta_rule", lambda query, key, value, **kwargs: None),
            id="kernel_signature_changed",
        ),
        pytest.param(
            lambda m, mp: mp.setattr(
                m.Qwen3_5GatedDeltaNet, "forward", lambda self, hidden_states, **kw: hidden_states
            ),
            id="mixer_no_longer_calls_kernels",
        ),
        pytest.param(lambda m, mp: mp.delattr(m, "Qwen3_5GatedDeltaNet"), id="mixer_class_removed"),
    ],
)
def test_tampered_modeling_module_is_refused(tamper, monkeypatch):
    model = tiny_model("qwen3_5")
    tamper(sys.modules[GDN_MODULE], monkeypatch)
    with pytest.raises(UnsupportedModelError, match="does not match") as err:
        patch_model(model)
    assert str(supported_families()) in str(err.value)
    for layout in ADAPTERS["qwen3_5"].layouts():  # what differs from each release's declaration
        assert f"declared for transformers {layout.release}" in str(err.value)
    assert not is_patched(model) and model.config._attn_implementation == "sdpa"


SEAMS = {"causal_conv1d_forward", "mamba2_scan_forward", "mamba_scan_forward"}


@pytest.mark.parametrize("family", [f for f in FAMILIES if ADAPTERS[f].older is not None])
def test_each_family_takes_the_declaration_of_the_installed_release(family):
    """transformers 5.25's mixers call replaceable kernel functions, which the families hook there
    (Mamba's mixer is re-stated over them: its fused training path gets no kwargs); 5.23's mixers call
    the functions those superseded. The module tells which one a model gets."""
    model = tiny_model(family)
    layout = ADAPTERS[family].layout(sys.modules[type(model).__module__])
    seams = Version(tf.__version__) >= Version("5.25")
    assert layout.release == ("5.25" if seams else "5.23")
    hooked = set(layout.kernels) | {k for m in layout.mixer_forwards.values() for k in KINDS[m].restates}
    assert bool(hooked & SEAMS) == seams, hooked


def _as_hub_module(fn):
    """``fn`` as transformers 5.25 (with ``kernels``) leaves a hub-replaceable function: an
    ``nn.Module`` instance whose ``forward`` closes over it."""

    def make(func):
        class Func(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Func()

    return make(fn)


def test_kernel_hooks_held_as_modules_are_read_through(monkeypatch):
    """A kernel function wrapped as 5.25 wraps it is checked by its own signature and source, and
    its tree calls bind their arguments by its names: the model patches and its tree run matches
    the unpatched model (``verify=True``); a drifted one is refused as drifted (no TypeError), with
    what to do."""
    module = sys.modules[GDN_MODULE]
    rule = module.torch_chunk_gated_delta_rule
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", _as_hub_module(rule))
    model = patch_model(tiny_model("qwen3_5"), verify=True)
    unpatch_model(model)
    assert isinstance(module.torch_chunk_gated_delta_rule, torch.nn.Module)  # the module is back
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", _as_hub_module(lambda query, key, value, **kw: None))
    monkeypatch.setattr(_compat.transformers, "__version__", "5.99.0")  # the module object _compat reads
    with pytest.raises(UnsupportedModelError, match="lost parameters") as err:
        patch_model(tiny_model("qwen3_5"))
    advice = f"pip install 'transformers~={_compat.CHECKED_TRANSFORMERS[-1]}.0'"
    assert "found transformers 5.99.0" in str(err.value) and advice in str(err.value)


def _lightning_without_norm_and_gate(
    self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs
):
    return self.out_proj(self.act_fn(self.qkv_proj(hidden_states))), None


def _mamba_layer_without_feed_forward(
    self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, **kwargs
):
    return hidden_states + self.mamba(self.input_layernorm(hidden_states), past_key_values, attention_mask)


def _scan_without_softplus(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, **kwargs):
    """A drifted discretisation (no softplus on dt): never run, only its source is checked."""
    dt = dt + delta_bias.to(dt.dtype)[..., None]
    return hidden_states * dt


@pytest.mark.parametrize(
    "family, owner, name, replacement",
    [
        pytest.param(
            "minimax", "MiniMaxLightningAttention", "forward", _lightning_without_norm_and_gate, id="minimax_mixer"
        ),
        pytest.param(
            "jamba", "JambaMambaDecoderLayer", "forward", _mamba_layer_without_feed_forward, id="jamba_mamba_layer"
        ),
        pytest.param("jamba", None, "mamba_selective_scan", _scan_without_softplus, id="jamba_selective_scan"),
    ],
)
def test_drifted_restated_code_is_refused(family, owner, name, replacement, monkeypatch):
    """MiniMax's lightning mixer and Jamba's Mamba mixer and layer are replaced whole on tree calls:
    a forward (or a kernel function the tree version re-implements) that no longer holds the code
    the tree version relies on is refused."""
    model = tiny_model(family)
    module = sys.modules[f"transformers.models.{family}.modeling_{family}"]
    monkeypatch.setattr(module if owner is None else vars(module)[owner], name, replacement)
    with pytest.raises(UnsupportedModelError, match=f"{name} no longer contains"):
        patch_model(model)
    assert not is_patched(model)


@pytest.mark.parametrize("family, mixer", [("jamba", "JambaMambaMixer"), ("mamba", "MambaMixer")])
def test_restated_decoder_layers_keep_gradient_checkpointing(family, mixer):
    """A decoder layer whose forward harts-hf replaces (it drops the tree kwarg) still recomputes in
    backward under gradient checkpointing, with and without a tree, as the unpatched layer does."""
    model = tiny_model(family)
    model.gradient_checkpointing_enable()
    model.train()
    layer = next(m for m in model.modules() if type(m).__name__ == mixer)
    runs = []
    layer.in_proj.register_forward_hook(lambda *_: runs.append(1))
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    forest = RolloutForest.from_sequences(family_forest(np.random.default_rng(0), small=True))

    def count(run) -> int:
        runs.clear()
        run().sum().backward()
        return len(runs)

    assert count(lambda: model(input_ids=ids, use_cache=False).logits) == 2
    patch_model(model)
    tree_logprobs(model, forest)  # the one-off no-grad probe of the tree tables
    assert count(lambda: tree_logprobs(model, forest)) == 2
    assert count(lambda: model(input_ids=ids, use_cache=False).logits) == 2


def test_unknown_layer_kind_is_refused():
    model = tiny_model("qwen3")
    model.config.layer_types = ["full_attention", "chunked_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        patch_model(model)


def test_attention_without_tree_support_is_refused():
    with pytest.raises(UnsupportedModelError, match="flash_attention_2"):
        tree_attention_name("flash_attention_2")


def test_from_pretrained_patches(tmp_path):
    tiny_model("lfm2").save_pretrained(tmp_path)
    model = from_pretrained(str(tmp_path))
    assert is_patched(model)
    forest = RolloutForest.from_sequences(family_forest(np.random.default_rng(0), small=True))
    assert tree_logprobs(model, forest).requires_grad


def test_every_supported_family_is_declared_once():
    """One declaration per family (``harts_hf.lab.models.FAMILIES``: the bench's models, the tests'
    tiny models and the TRL suites' stand-ins read it) for exactly the families the adapter table
    patches, under the same names."""
    from harts_hf.lab.models import BENCH_FAMILIES, FAMILIES

    assert sorted(FAMILIES) == supported_families()
    assert set(BENCH_FAMILIES) <= set(FAMILIES)
    assert all(FAMILIES[name].arch is not None for name in BENCH_FAMILIES)
