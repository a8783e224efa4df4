"""Whether ``tandem serve`` / ``tandem generate`` speculate: MTP by default on CUDA when the
model has a head, off on the CPU; ``--speculative``, ``--speculative-model`` and
``--no-speculative`` decide when given."""

from __future__ import annotations

import argparse

import pytest

from tandem.cli import add_engine_arguments, speculative_method
from tandem.models.mtp import has_mtp_head


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    add_engine_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_default_model_has_its_shipped_head_and_dummy_models_have_none():
    assert has_mtp_head(None)
    assert not has_mtp_head("dummy:llama3-8b")


@pytest.mark.parametrize(
    "argv, method",
    [
        ((), None),  # the CPU: off by default
        (("--device", "cuda"), "mtp"),  # the default model's shipped head
        (("--device", "cuda:1"), "mtp"),
        (("--device", "cuda", "--no-speculative"), None),
        (("--device", "cuda", "--model", "dummy:llama3-8b"), None),  # no head
        (("--speculative", "mtp"), "mtp"),  # asked for, on the CPU too
        (("--speculative-model", "dummy"), "mtp"),
    ],
)
def test_speculation_defaults_to_mtp_on_cuda_when_the_model_has_a_head(argv, method):
    assert speculative_method(_args(*argv)) == method


def test_no_speculative_contradicting_a_method_is_refused():
    with pytest.raises(SystemExit, match="contradicts"):
        speculative_method(_args("--no-speculative", "--speculative", "mtp"))
