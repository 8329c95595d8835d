"""`key_inductor_caches_by_cpu_isa`: inductor's on-disk cache keys name the CPU vector ISA it
generates code for, so a graph cached under one `ATEN_CPU_CAPABILITY` (or on another host)
is never built for another ISA (torch 2.13 leaves the ISA out of its FX graph and
AOTAutograd cache keys; a 16-lane AVX512 loop built for 8-lane AVX2 gives NaN losses)."""

from __future__ import annotations

import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa

from nanotrain.models.compile import CPU_ISA_TAG, key_inductor_caches_by_cpu_isa

# torch's own config patch, not monkeypatch: pytest 9.2's monkeypatch undoes an attribute
# missing from a module's __dict__ (a ConfigModule keeps its entries elsewhere) by deleting it,
# which removes the entry from torch.compiler.config for every later test in the process


def test_inductor_cache_keys_name_the_cpu_isa_and_keep_the_users_tag(monkeypatch):
    tags = {}
    with torch.compiler.config.patch(cache_key_tag="users-tag"):
        for capability in ("default", "avx2", "default"):
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
            key_inductor_caches_by_cpu_isa({})  # the inductor backend (torch.compile's default)
            tag = torch.compiler.config.cache_key_tag
            # the ISA the code generator picks under this capability, once, after the user's tag
            assert tag == f"users-tag;{CPU_ISA_TAG}{pick_vec_isa()}"
            tags.setdefault(capability, tag)
            assert tag == tags[capability]  # switching back gives the first key again
    # "default" generates scalar code, avx2 8-lane vectors: different cache entries
    assert tags["default"] != tags["avx2"]


def test_backends_without_cpp_code_leave_the_cache_tag_alone():
    with torch.compiler.config.patch(cache_key_tag="users-tag"):
        key_inductor_caches_by_cpu_isa({"backend": "aot_eager"})
        assert torch.compiler.config.cache_key_tag == "users-tag"
