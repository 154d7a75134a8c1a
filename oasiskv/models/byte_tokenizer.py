"""A byte-level stand-in tokenizer for models without a tokenizer of their own (`random:`
models): ids 0-255 are the bytes of the UTF-8 text, 256 is BOS (`<s>`, prepended) and 257 EOS
(`</s>`). Built with the `tokenizers` library, nothing downloaded. Ids past 257 (a model's
larger vocabulary) decode to nothing."""

from __future__ import annotations

from functools import cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

BOS_ID, EOS_ID = 256, 257


@cache
def _byte_chars() -> dict[int, str]:
    """Byte -> the printable character byte-level BPE spells it with (GPT-2's table, which
    the `tokenizers` ByteLevel pre-tokenizer and decoder use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """The stand-in tokenizer: a byte-level BPE with no merges, so token i is byte i."""
    vocab = {char: b for b, char in _byte_chars().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
