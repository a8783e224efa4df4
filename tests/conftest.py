"""Shared fixtures: engines built once per session, and the block-accounting check that runs
after every test (DESIGN.md invariant 4: when every request has ended, every KV block is free)."""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict

# Without a GPU, Triton kernels can only run in Triton's interpreter: switch it on before
# anything (torch included) imports triton, so every test sees the same mode.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tandem import LLM

# The helper modules beside the tests (imported by name: pytest puts a test's folder on
# sys.path) get pytest's assert rewriting too, so their failed asserts show their values.
pytest.register_assert_rewrite(
    "mtp_head_helpers", "scheduler_driver", "server_helpers", "rejection_stats", "pd_steps"
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Engines kept alive at once in one test process (`make test` runs two, each with its own):
# each holds its own fp32 weights and KV cache (over 1 GiB), and CI has 24 GiB (at least
# 4.7 GB stayed free with two processes, docs/testing.md); tests that share a configuration
# run next to each other.
MAX_CACHED_ENGINES = 4
# The engines of ``make_llm`` on another device and dtype: the GPU run of the CPU suite's
# engine tests (``TANDEM_TEST_DEVICE=cuda TANDEM_TEST_DTYPE=float32
# TANDEM_TEST_KV_CACHE_GB=4``: several engines share the GPU); a test that names one keeps
# its own.
TEST_ENGINE_DEFAULTS = {
    key: kind(os.environ[name])
    for key, name, kind in (
        ("device", "TANDEM_TEST_DEVICE", str),
        ("dtype", "TANDEM_TEST_DTYPE", str),
        ("kv_cache_memory_gb", "TANDEM_TEST_KV_CACHE_GB", float),
    )
    if os.environ.get(name)
}


@pytest.fixture(scope="session")
def llm_cache():
    """Engines by configuration, so each distinct engine loads once per session (the least
    recently used beyond MAX_CACHED_ENGINES are shut down)."""
    return OrderedDict()


@pytest.fixture(scope="session")
def cached_llm(llm_cache):
    """``cached_llm(**kwargs)`` returns the cached LLM of that configuration (the test
    engine defaults applied, as ``make_llm`` does), without ``make_llm``'s checks: for
    module-scoped fixtures, which then share ``make_llm``'s engines and device."""

    def factory(**kwargs) -> LLM:
        kwargs = {**TEST_ENGINE_DEFAULTS, **kwargs}
        key = tuple(sorted(kwargs.items()))
        if key not in llm_cache:
            while len(llm_cache) >= MAX_CACHED_ENGINES:
                _, evicted = llm_cache.popitem(last=False)
                evicted.engine.shutdown()
            llm_cache[key] = LLM(**kwargs)
        llm_cache.move_to_end(key)
        return llm_cache[key]

    return factory


@pytest.fixture
def make_llm(cached_llm, request):
    """``make_llm(**kwargs)`` returns a (cached) LLM; every engine used by the test is
    checked after it for leaked KV blocks and unfinished requests."""
    used: list[LLM] = []

    def factory(**kwargs) -> LLM:
        used.append(cached_llm(**kwargs))
        return used[-1]

    yield factory
    for llm in used:
        core = llm.engine
        assert not core.has_unfinished_requests(), "a request was left unfinished"
        assert core.block_manager.all_blocks_free(), (
            f"KV blocks leaked: {core.block_manager.num_free_blocks} of {core.num_blocks} free"
        )


@pytest.fixture
def llm(make_llm) -> LLM:
    """The default model with default settings."""
    return make_llm()
