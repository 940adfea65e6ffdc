"""Corpus, tokenizer, training and acceptance evaluation of the bundled tiny DeepSeek-V3 + MTP model."""
