"""A character-level chat tokenizer built in code: no download, no training, same ids everywhere.

The built-in environment, the ``train`` command and the tests need a tokenizer that TRL accepts
(a ``PreTrainedTokenizerFast`` with pad / eos tokens and a chat template) on a machine without
network. Every printable ASCII character and newline is one token; eight special tokens mark chat
roles and the scaffold's structure. 104 ids: fits the tiny models' 128-token vocabulary.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tokenizer"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|act|>")
"""Ids 0-7: padding, begin / end of sequence, chat roles, and the marker that opens an action."""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""``<bos><|role|>content...`` with ``<|assistant|>`` as the generation prompt (roles: system, user,
assistant, tool)."""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer: special tokens 0-7, then newline and printable ASCII (32-126)."""
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
        padding_side="left",
        truncation_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
