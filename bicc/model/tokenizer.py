"""A character-level tokenizer built locally, saved and loaded like any HF tokenizer.

The embedded task needs no hub access: every printable ASCII character and the newline is one
token, and the chat markers follow Qwen's ChatML so prompts look like the real models' prompts.
The result is a ``PreTrainedTokenizerFast``, so ``save_pretrained`` / ``AutoTokenizer.from_pretrained``
round-trip it and the training code never special-cases it.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]

# ChatML, as Qwen models use it; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """Specials first (ids 0-3), then newline and printable ASCII 32..126; ``vocab_size``: filled to that many
    ids with ``<|extra_i|>`` tokens (a real model's vocabulary size: what a random model samples decodes)."""
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    base = SPECIAL_TOKENS + chars
    if vocab_size is not None and vocab_size < len(base):
        raise ValueError(f"vocab_size={vocab_size}: the character tokenizer needs at least {len(base)} ids")
    extra = [f"<|extra_{i}|>" for i in range((vocab_size or len(base)) - len(base))]
    vocab = {tok: i for i, tok in enumerate(base + extra)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # One token per character, newlines included ([\s\S] matches any character).
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        bos_token=None,
        additional_special_tokens=[BOS_TOKEN],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    return tok
