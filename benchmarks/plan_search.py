"""CPU seconds of `search_layouts` for DeepSeek-V3 on 2,048 H800s (ZeRO-1, the batch of
docs/planning.md's worked example), on a seeded sample of the candidate layouts or on all.

    python benchmarks/plan_search.py            # 40 of the 430 candidates
    python benchmarks/plan_search.py --all      # every candidate (the full search)
    python benchmarks/plan_search.py --all --out result.txt   # and the whole result

Prints the process CPU seconds, the wall seconds and how many layouts fit / were rejected.
`--out FILE` writes every plan that fits (ranked) and every rejection, each as its full
`repr` on one line, and prints the file's SHA-256: two versions of the planner give the
same search exactly when their files compare equal.
"""

from __future__ import annotations

import hashlib
import random
import sys
import time

from nanotrain.models import presets
from nanotrain.planning import gpu_spec, search


def main() -> None:
    """Run the (sampled) search once and print its timing."""
    config, gpu = presets.get("deepseek-v3-671b"), gpu_spec("h800")
    if "--all" not in sys.argv:
        candidates = list(search._candidates(config, 2048, gpu, (1,)))
        sample = random.Random(0).sample(candidates, 40)
        search._candidates = lambda *args, **kwargs: iter(sample)
    cpu, wall = time.process_time(), time.time()
    result = search.search_layouts(
        config, 2048, gpu, seq_len=4096, global_batch_tokens=62914560, zero_stages=(1,)
    )
    cpu, wall = time.process_time() - cpu, time.time() - wall
    print(f"cpu {cpu:.1f} s, wall {wall:.1f} s, {len(result.fitting)} fit, "
          f"{len(result.rejected)} rejected")  # fmt: skip
    if "--out" in sys.argv:
        lines = [repr(p) for p in result.fitting] + ["---"] + [repr(r) for r in result.rejected]
        text = "\n".join(lines) + "\n"
        with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
            f.write(text)
        print(f"sha256 {hashlib.sha256(text.encode()).hexdigest()}")


if __name__ == "__main__":
    main()
