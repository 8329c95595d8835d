"""nanotrain.parallel: the Megatron machinery (mesh, collectives, parallel layers).

Knows nothing of the Trainer. Process groups live in a ``ParallelMesh`` that is passed to
whoever needs it; nothing here keeps module-level state.
"""

from nanotrain.parallel.collectives import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from nanotrain.parallel.cross_entropy import vocab_parallel_cross_entropy
from nanotrain.parallel.mesh import AXES, MeshCoords, MeshLayout, ParallelMesh, validate_layout
from nanotrain.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    pad_vocab_size,
    shard_tensor,
)

__all__ = [
    "AXES",
    "ColumnParallelLinear",
    "MeshCoords",
    "MeshLayout",
    "ParallelMesh",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "pad_vocab_size",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "shard_tensor",
    "validate_layout",
    "vocab_parallel_cross_entropy",
]
