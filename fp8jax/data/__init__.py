"""Training text for the demo: byte tokens from the Python standard library or a text file."""
from fp8jax.data.corpus import (VOCAB_SIZE, Corpus, CorpusError, stdlib_corpus, text_file_corpus,
                                train_batch, validation_batches)

__all__ = [
    "VOCAB_SIZE", "Corpus", "CorpusError",
    "stdlib_corpus", "text_file_corpus",
    "train_batch", "validation_batches",
]
