"""The data layer: corpora, tokenizers, cached token files and deterministic sampling.

``prepare_data(cfg)`` turns a ``DataConfig`` into a ``DataBundle`` (tokenizer, train and
validation token memmaps); ``BatchSampler`` draws batches from a token array as a pure function of
(seed, step), sliced by data-parallel rank.
"""

from threefold.data.corpus import Corpus, read_corpus
from threefold.data.errors import DataError
from threefold.data.sampler import BatchSampler
from threefold.data.tokenizer import EOT, PAD, eot_id, load_tokenizer, train_bpe
from threefold.data.tokens import DataBundle, prepare_data

__all__ = ["BatchSampler", "Corpus", "DataBundle", "DataError", "EOT", "PAD", "eot_id",
           "load_tokenizer", "prepare_data", "read_corpus", "train_bpe"]
