"""The data layer: corpora, tokenizers, prepared token shards and deterministic sampling.

``prepare_data(cfg)`` turns a ``DataConfig`` into a ``DataBundle`` (tokenizer and token
sources, each with its held-out tail); ``MixtureSampler`` draws training rows from the sources
in epochs and in proportion, as a pure function of (seed, step), sliced by data-parallel rank.
"""

from threefold.data.corpus import Corpus, read_corpus
from threefold.data.errors import DataError
from threefold.data.sampler import HeldOutSampler, MixtureSampler
from threefold.data.sources import TokenSource
from threefold.data.tokenizer import EOT, PAD, eot_id, load_tokenizer, train_bpe
from threefold.data.tokens import DataBundle, prepare_data

__all__ = ["Corpus", "DataBundle", "DataError", "EOT", "HeldOutSampler", "MixtureSampler", "PAD",
           "TokenSource", "eot_id", "load_tokenizer", "prepare_data", "read_corpus", "train_bpe"]
