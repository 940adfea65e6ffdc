"""Byte-level BPE tokenizer for the bundled model, trained with the `tokenizers` library.

Every encoding starts with `<|bos|>` (the post-processor adds it), documents end with `<|eos|>`.
Saved as `tokenizer.json` (read by `tokenizers.Tokenizer.from_file` in serving) plus
`tokenizer_config.json` (read by transformers' `AutoTokenizer`).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<|bos|>"
EOS = "<|eos|>"
SPECIAL_TOKENS = [BOS, EOS]  # ids 0, 1


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of `vocab_size` tokens (specials and the 256 bytes included)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as `<|bos|> tokens <|eos|>`."""
    eos_id = tokenizer.token_to_id(EOS)
    return [enc.ids + [eos_id] for enc in tokenizer.encode_batch(texts)]
