"""Train the reference model's byte-level BPE tokenizer with `tokenizers` and wrap it for transformers."""
from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
PAD = "<pad>"


def sentinels(count: int) -> list[str]:
    """T5's span-corruption sentinels, <extra_id_0> ... <extra_id_{count - 1}>."""
    return [f"<extra_id_{i}>" for i in range(count)]


def train_bpe(texts: Iterable[str], vocab_size: int, sentinel_count: int = 0):
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenisation) as a transformers fast tokenizer. With
    `sentinel_count`, an encoder-decoder's: `<pad>` (id 0, T5's decoder start), EOS, then the sentinels."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, *sentinels(sentinel_count)] if sentinel_count else [EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if sentinel_count:
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token=None, pad_token=PAD,
                                       additional_special_tokens=sentinels(sentinel_count))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=None, pad_token=EOS
    )
