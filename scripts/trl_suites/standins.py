"""Offline stand-ins for the Hub models and datasets TRL's trainer tests load.

TRL's tests name tiny Hub checkpoints (``trl-internal-testing/tiny-*``) and the ``zen`` datasets; this
machine has no network. So we build, once per output directory:

* models: tiny random hybrids of this project's families (Qwen3.5 GDN + attention for most causal-LM
  ids, Qwen3.5-MoE for the MoE ids, Nemotron-H and LFM2 for theirs, a Qwen3.5 sequence-classification
  head for the reward-model ids), each with an in-code character tokenizer and the Qwen chat template
  TRL recognises, laid out as a private Hugging Face Hub cache (``<root>/hub``) so that every loader
  (``from_pretrained`` of any class, ``AutoTokenizer``, ``hf_hub_download``) finds them with
  ``HF_HUB_OFFLINE=1``. Vision-language ids and remote-code ids have no stand-in: the plugin reports
  tests that need them as skipped.
* datasets: TRL's own generator scripts (``<trl repo>/scripts/generate_*_dataset.py``) run with their
  ``push_to_hub`` redirected to parquet files under ``<root>/datasets``; :func:`load_dataset` maps the
  Hub ids onto them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as tf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from harts_hf.lab.models import FAMILIES, TINY_VOCAB

__all__ = ["MODEL_IDS", "build", "hub_cache", "install_datasets", "provided"]

COMMIT = "0" * 40  # the fake revision every stand-in is stored under (refs/main)
VOCAB = TINY_VOCAB
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|finetune_right_pad_id|>"]
"""Qwen's pad / turn markers, one token each (plus the pad token the Llama reward test sets)."""
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# the stand-ins' models: a family of harts_hf.lab.models.FAMILIES (its tiny config), the model class
STANDINS: dict[str, tuple[str, str, dict]] = {
    "qwen3_5": ("qwen3_5", "Qwen3_5ForCausalLM", {}),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM", {}),
    "qwen3_5_reward": ("qwen3_5", "Qwen3_5TextForSequenceClassification", dict(num_labels=1)),
    "nemotron_h": ("nemotron_h", "NemotronHForCausalLM", {}),
    "lfm2": ("lfm2", "Lfm2ForCausalLM", {}),
}
_SHARED = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
               max_position_embeddings=4096, initializer_range=0.1, tie_word_embeddings=False)  # fmt: skip

_T = "trl-internal-testing/tiny-"
# Hub id -> (family, chat template file in the installed trl's chat_templates/, or None for no template)
MODEL_IDS: dict[str, tuple[str, str | None]] = {
    **{_T + n: ("qwen3_5", "qwen2_5.jinja") for n in [
        "Qwen2ForCausalLM-2.5", "LlamaForCausalLM-3", "LlamaForCausalLM-3.1", "LlamaForCausalLM-3.2",
        "MistralForCausalLM-0.1", "MistralForCausalLM-0.2", "GemmaForCausalLM", "Gemma2ForCausalLM",
        "Phi3ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "Olmo3ForCausalLM"]},
    **{_T + n: ("qwen3_5_moe", "qwen2_5.jinja") for n in [
        "Qwen3MoeForCausalLM", "GptOssForCausalLM", "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM",
        "DeepseekV3ForCausalLM-0528"]},
    _T + "Qwen3ForCausalLM": ("qwen3_5", "qwen3.jinja"),
    _T + "GPTNeoXForCausalLM": ("qwen3_5", None),  # the real one ships no chat template either
    _T + "NemotronHForCausalLM-nano": ("nemotron_h", "qwen2_5.jinja"),
    _T + "Lfm2ForCausalLM": ("lfm2", "qwen2_5.jinja"),
    _T + "Lfm2ForCausalLM-2.5": ("lfm2", "qwen2_5.jinja"),
    **{_T + n: ("qwen3_5_reward", "qwen2_5.jinja") for n in [
        "Qwen2ForSequenceClassification-2.5", "Qwen3ForSequenceClassification", "LlamaForSequenceClassification-3.2"]},
    "Qwen/Qwen2.5-0.5B-Instruct": ("qwen3_5", "qwen2_5.jinja"),
    "Qwen/Qwen3-4B": ("qwen3_5", "qwen3.jinja"),
}  # fmt: skip

GENERATORS = {  # Hub dataset id -> TRL generator script (run from the TRL checkout)
    "trl-internal-testing/zen": "generate_zen_dataset.py",
    "trl-internal-testing/zen-image": "generate_zen_image_dataset.py",
    "trl-internal-testing/zen-multi-image": "generate_zen_multi_image_dataset.py",
    "trl-internal-testing/toolcall": "generate_toolcall_dataset.py",
    "trl-internal-testing/harmony": "generate_harmony_dataset.py",
}


def provided() -> set[str]:
    """Every Hub id (model or dataset) that has a stand-in."""
    return set(MODEL_IDS) | set(GENERATORS)


def hub_cache(root: Path) -> Path:
    return Path(root) / "hub"


# ---------------------------------------------------------------- tokenizer and models
def build_tokenizer(template: str | None) -> tf.PreTrainedTokenizerFast:
    """Printable ASCII and newline one token each, Qwen's markers and tags one token each; Qwen's
    pad / eos tokens (``<|endoftext|>`` / ``<|im_end|>``), left padding as Qwen ships it."""
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL, *TAGS, *chars])}
    assert len(vocab) <= VOCAB
    core = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    core.add_tokens([AddedToken(t, normalized=False) for t in TAGS])
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    if template is not None:
        import trl

        tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / template).read_text()
    return tok


def build_model(family: str, tok: tf.PreTrainedTokenizerFast, seed: int = 0) -> tf.PreTrainedModel:
    """A freshly initialised tiny ``family`` model whose special ids are ``tok``'s."""
    name, model_cls, extra = STANDINS[family]
    spec = FAMILIES[name]
    kwargs = {**_SHARED, **spec.tiny, **extra, "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
    for key in ("layer_types", "layers_block_type"):
        if key in kwargs:
            kwargs["num_hidden_layers"] = len(kwargs[key])
    config = getattr(tf, spec.config)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(tf, model_cls)(config)
    if model.can_generate():
        end = tok.convert_tokens_to_ids("<|endoftext|>")
        model.generation_config = tf.GenerationConfig(eos_token_id=[tok.eos_token_id, end], pad_token_id=end)
    return model


def _write_repo(cache: Path, repo_id: str, kind: str, fill: Callable[[Path], None]) -> None:
    """One repo of the Hub cache layout: ``<kind>s--org--name/{refs/main, snapshots/<COMMIT>/...}``."""
    repo = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    fill(snap)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)


def build_models(root: Path) -> None:
    cache = hub_cache(root)
    for repo_id, (family, template) in MODEL_IDS.items():

        def fill(snap: Path, family: str = family, template: str | None = template) -> None:
            tok = build_tokenizer(template)
            build_model(family, tok).save_pretrained(snap)
            tok.save_pretrained(snap)

        _write_repo(cache, repo_id, "model", fill)


# ---------------------------------------------------------------- datasets
def build_datasets(root: Path, trl_repo: Path) -> None:
    """Run TRL's dataset generators with ``push_to_hub`` writing ``<config>/<split>.parquet`` locally."""
    import datasets

    out = Path(root) / "datasets"

    def save(self, repo_id: str, config_name: str = "default", **_: object) -> None:
        splits = self.items() if isinstance(self, datasets.DatasetDict) else [("train", self)]
        target = out / repo_id / config_name
        target.mkdir(parents=True, exist_ok=True)
        for split, ds in splits:
            ds.to_parquet(str(target / f"{split}.parquet"))

    saved = datasets.Dataset.push_to_hub, datasets.DatasetDict.push_to_hub
    datasets.Dataset.push_to_hub = datasets.DatasetDict.push_to_hub = save
    try:
        for repo_id, script in GENERATORS.items():
            spec = importlib.util.spec_from_file_location(f"_trl_gen_{script[:-3]}", trl_repo / "scripts" / script)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.main(test_size=0.1, push_to_hub=True, repo_id=repo_id)
    finally:
        datasets.Dataset.push_to_hub, datasets.DatasetDict.push_to_hub = saved


def install_datasets(root: Path) -> None:
    """Make ``datasets.load_dataset`` answer the stand-in Hub ids from ``<root>/datasets`` (any other
    id goes to the real function, which fails offline). Patched on the module before the test files
    run ``from datasets import load_dataset``."""
    import datasets

    real = datasets.load_dataset
    base = Path(root) / "datasets"

    def load_dataset(path: str, name: str | None = None, *args, **kwargs):
        local = base / str(path)
        if str(path) in GENERATORS and local.is_dir():
            configs = sorted(p.name for p in local.iterdir())
            name = name or (configs[0] if len(configs) == 1 else None)
            if name not in configs:
                raise ValueError(f"stand-in {path!r} has no config {name!r}; it has {configs}")
            files = {p.stem: str(p) for p in sorted((local / name).glob("*.parquet"))}
            return real("parquet", data_files=files, *args, **kwargs)
        return real(path, name, *args, **kwargs)

    load_dataset.__wrapped__ = real
    datasets.load_dataset = load_dataset
    import datasets.load

    datasets.load.load_dataset = load_dataset


# ---------------------------------------------------------------- all of it
def build(root: Path, trl_repo: Path) -> Path:
    """Build every stand-in under ``root`` once (a marker file records completion); returns ``root``."""
    root = Path(root)
    marker = root / "built.json"
    if marker.exists():
        return root
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    os.environ.setdefault("HF_DATASETS_CACHE", str(root / "datasets_cache"))
    build_models(root)
    build_datasets(root, Path(trl_repo))
    marker.write_text(json.dumps({"models": sorted(MODEL_IDS), "datasets": sorted(GENERATORS)}, indent=1))
    return root


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="build the offline stand-ins")
    parser.add_argument("root", type=Path)
    parser.add_argument("--trl-repo", type=Path, required=True)
    a = parser.parse_args()
    print(build(a.root, a.trl_repo))
