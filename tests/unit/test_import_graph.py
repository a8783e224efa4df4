"""The package's import graph (DESIGN.md, "Layout": every file imports only downward).

The layers and the rules live here; the checker that reads the graph from the source (with
``ast``, importing nothing) is ``import_graph.py`` beside this file. Its tests on small trees
are at the end. The runtime edges through package ``__init__.py`` files are checked by the
fresh-interpreter test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from import_graph import (
    PACKAGE,
    ImportGraph,
    build_graph,
    find_circles,
    forbidden_imports,
    layer_violations,
    torch_chains,
)

REPO = Path(__file__).resolve().parents[2]

# Layers, highest first. A file may import files of lower layers and of its own area; never
# a file of a higher layer, nor one of another area of its own layer (core and disagg sit
# side by side and import neither the other). An entry is a file or a folder (ending in
# "/"); the longest entry that covers a file gives its area. A file no entry covers fails.
LAYERS: list[tuple[int, str, tuple[str, ...]]] = [
    (
        7,
        "face",
        (
            "tandem/__init__.py",
            "tandem/cli.py",
            "tandem/engine_options.py",  # the engine options of cli.py's commands
            "tandem/llm.py",
            "tandem/output_processor.py",  # detokenizer and stop strings of llm.py and server/
            "tandem/server/",
            "tandem/bench/",
            "tandem/train/",
        ),
    ),
    # The process around the engine loop: it attaches the PD role to the core.
    (6, "engine process", ("tandem/engine_process.py",)),
    (5, "core", ("tandem/core/",)),
    (5, "disagg", ("tandem/disagg/",)),
    (4, "worker", ("tandem/worker/",)),
    (3, "models", ("tandem/models/",)),
    (2, "layers", ("tandem/layers/",)),
    (
        1,
        "leaves",
        (
            "tandem/config.py",
            "tandem/sampling_params.py",
            "tandem/request.py",
            "tandem/step.py",
            "tandem/outputs.py",
            "tandem/tokenizer.py",
            "tandem/tokenizer_cache.py",  # converted GGUF tokenizers on disk
            "tandem/messages.py",  # the typed messages between processes
            "tandem/wire.py",  # their wire form and checks
            "tandem/device_copy.py",  # host/device copies
        ),
    ),
]

# Files that must stay free of torch, with everything of the package they import.
TORCH_FREE = (
    "tandem/core/scheduler.py",
    "tandem/core/kv_cache.py",
    "tandem/request.py",
    "tandem/step.py",
    "tandem/sampling_params.py",
    "tandem/config.py",
)
HTTP_LIBRARIES = {"fastapi", "httpx", "uvicorn", "starlette"}


# ---- the package --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return build_graph(REPO)


def _fail_on(problems: list[str], what: str) -> None:
    if problems:
        pytest.fail(f"{what}:\n" + "\n".join(problems), pytrace=False)


def test_no_import_circle_between_files(graph):
    _fail_on(find_circles(graph), "files that import each other in a circle")


def test_scheduler_and_block_manager_import_no_torch(graph):
    roots = [file for file in TORCH_FREE if file in graph.files]
    assert {"tandem/core/scheduler.py", "tandem/core/kv_cache.py"} <= set(roots), (
        "the scheduler or the block manager moved: update TORCH_FREE"
    )
    _fail_on(torch_chains(graph, roots), "torch-free files that reach torch")


def test_scheduler_and_block_manager_load_no_torch_in_a_fresh_interpreter():
    """Python runs every package __init__.py on the way: ``tandem/__init__.py`` must import
    lazily for the scheduler to load without torch."""
    script = textwrap.dedent(
        """
        import os, sys, traceback

        package = sys.argv[1]

        class Spy:  # records who asks for torch first
            chain = None

            def find_spec(self, name, path=None, target=None):
                if name == "torch" and Spy.chain is None:
                    Spy.chain = [
                        f"{os.path.relpath(f.filename, os.path.dirname(package))}:{f.lineno}"
                        for f in traceback.extract_stack()
                        if f.filename.startswith(package + os.sep)
                    ]

        sys.meta_path.insert(0, Spy())
        import tandem.core.kv_cache
        import tandem.core.scheduler

        print(os.path.dirname(tandem.__file__))
        print(" -> ".join(Spy.chain) if "torch" in sys.modules else "")
        """
    )
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    result = subprocess.run(
        [sys.executable, "-c", script, str(REPO / PACKAGE)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    loaded_from, torch_chain = result.stdout.splitlines()
    assert Path(loaded_from) == REPO / PACKAGE, f"imported another tree: {loaded_from}"
    if torch_chain:
        pytest.fail(
            f"loading the scheduler and block manager loaded torch: {torch_chain}", pytrace=False
        )


def test_models_and_layers_import_no_request_serving_engine_or_worker(graph):
    problems = forbidden_imports(
        graph,
        ("tandem/layers/", "tandem/models/"),
        (
            "tandem/request.py",
            "tandem/sampling_params.py",
            "tandem/server/",
            "tandem/core/",
            "tandem/disagg/",
            "tandem/worker/",
        ),
    )
    _fail_on(problems, "models and layers reaching above themselves")


def test_models_and_layers_import_no_http_library(graph):
    problems = [
        f"{edge} (an HTTP library)"
        for file in graph.files
        if file.startswith(("tandem/layers/", "tandem/models/"))
        for edge in graph.external(file)
        if edge.target in HTTP_LIBRARIES
    ]
    _fail_on(problems, "models and layers importing an HTTP library")


def test_core_imports_nothing_from_server_or_disagg(graph):
    problems = forbidden_imports(graph, ("tandem/core/",), ("tandem/server/", "tandem/disagg/"))
    _fail_on(problems, "the core importing serving or PD code")


def test_worker_imports_nothing_from_core(graph):
    problems = forbidden_imports(graph, ("tandem/worker/",), ("tandem/core/",))
    _fail_on(problems, "the worker importing the core (step messages belong in tandem/step.py)")


def test_every_file_imports_only_lower_layers(graph):
    _fail_on(layer_violations(graph, LAYERS), "imports against LAYERS")


# ---- the checker on small trees -----------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> ImportGraph:
    for name, text in files.items():
        path = root / "tandem" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return build_graph(root)


def test_checker_finds_a_circle_through_a_function_level_relative_import(tmp_path):
    graph = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/a.py": "from tandem.core import b\n",
            "core/b.py": "def late():\n    from .a import name\n",
        },
    )
    (report,) = find_circles(graph)
    assert report.splitlines() == [
        "circle: tandem/core/a.py -> tandem/core/b.py -> tandem/core/a.py",
        "    tandem/core/a.py:1 `from tandem.core import b`",
        "    tandem/core/b.py:2 `from .a import name`",
    ]


def test_checker_passes_a_clean_tree_and_ignores_type_checking_imports(tmp_path):
    graph = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "request.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from tandem.worker.runner import Runner\n"
            ),
            "core/scheduler.py": "import tandem.request\n",
            "worker/runner.py": "import torch\nfrom tandem import request\n",
        },
    )
    layers = [(3, "core", ("tandem/core/",)), (2, "worker", ("tandem/worker/",))]
    layers += [(1, "leaves", ("tandem/__init__.py", "tandem/request.py"))]
    assert find_circles(graph) == []
    assert torch_chains(graph, ["tandem/core/scheduler.py"]) == []
    assert layer_violations(graph, layers) == []
    assert forbidden_imports(graph, ("tandem/worker/",), ("tandem/core/",)) == []
    assert [str(i) for i in graph.internal("tandem/worker/runner.py")] == [
        "tandem/worker/runner.py:2 `from tandem import request`"
    ]


def test_checker_follows_torch_and_layers_through_the_tree(tmp_path):
    graph = _tree(
        tmp_path,
        {
            "request.py": "import tandem.transfer\n",
            "transfer.py": "import torch.cuda\n",
            "models/llama.py": "from tandem.request import Request\n",
            "extra.py": "",
        },
    )
    assert torch_chains(graph, ["tandem/request.py"]) == [
        "tandem/request.py:1 `import tandem.transfer` -> tandem/transfer.py:1 `import torch.cuda`"
    ]
    layers = [(2, "models", ("tandem/models/",)), (1, "leaves", ("tandem/transfer.py",))]
    layers += [(3, "face", ("tandem/request.py",))]
    assert layer_violations(graph, layers) == [
        "file tandem/extra.py has no layer: add it to LAYERS",
        "tandem/models/llama.py:1 `from tandem.request import Request`: models (layer 2) "
        "imports tandem/request.py, face (layer 3)",
    ]
