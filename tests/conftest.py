"""Suite-wide settings: one intra-op thread per process.

The suite runs on 2 shared cores; tiny models gain nothing from a thread pool, and several
pools (pytest plus spawned ranks or CLI subprocesses) oversubscribe the cores badly.
"""

import torch

torch.set_num_threads(1)
