"""Token data: tokenizers, `prepare` (text → token shards), the demo corpus, the memory-mapped
`TokenShardDataset`, blends (`BlendedDataset`), streams (`streaming`), the
`ResumableDistributedSampler` and the `TokenDataModule`.

See docs/data.md for the on-disk format and the sampler's ordering guarantee.
"""

from .blend import BlendedDataset
from .datamodule import TokenDataModule
from .dataset import TokenShardDataset, check_vocab
from .demo import DEFAULT_DEMO_BYTES, default_cache_dir, demo_corpus_files, prepare_demo
from .metadata import read_metadata
from .prepare import prepare
from .sampler import ResumableDistributedSampler
from .tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "DEFAULT_DEMO_BYTES",
    "BlendedDataset",
    "ByteTokenizer",
    "HFTokenizer",
    "ResumableDistributedSampler",
    "TokenDataModule",
    "TokenShardDataset",
    "Tokenizer",
    "check_vocab",
    "default_cache_dir",
    "demo_corpus_files",
    "load_tokenizer",
    "prepare",
    "prepare_demo",
    "read_metadata",
    "train_bpe",
]
