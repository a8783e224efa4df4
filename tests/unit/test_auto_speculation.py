"""Speculation by default: ``tandem serve`` / ``generate`` ask for "auto", which is MTP on
CUDA when the model has a head and off elsewhere (no GPU is needed: only the config is
resolved here, no engine starts)."""

from __future__ import annotations

import argparse

import pytest

from tandem.engine_options import add_engine_arguments, engine_kwargs
from tandem.llm import engine_config
from tandem.models.loader import ModelFiles
from tandem.models.mtp import has_mtp_head, resolve_auto_speculation


def _resolved(model: str | None, device: str, **options):
    config = engine_config(model, device=device, speculative="auto", **options)
    return resolve_auto_speculation(config, ModelFiles(model)).speculative


def test_auto_is_mtp_with_the_shipped_head_on_cuda():
    spec = _resolved(None, "cuda", num_speculative_tokens=2)
    assert (spec.method, spec.num_speculative_tokens, spec.model) == ("mtp", 2, None)


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_auto_is_off_on_the_cpu(device):
    spec = _resolved(None, device)
    assert (spec.method, spec.num_speculative_tokens) == (None, 0)


def test_auto_is_off_for_a_model_without_a_head_and_on_with_a_named_one():
    assert not has_mtp_head(ModelFiles("dummy:tiny"))
    spec = _resolved("dummy:tiny", "cuda")
    assert (spec.method, spec.num_speculative_tokens) == (None, 0)
    spec = _resolved("dummy:tiny", "cuda", speculative_model="dummy")
    assert (spec.method, spec.num_speculative_tokens, spec.model) == ("mtp", 3, "dummy")


def test_an_explicit_method_is_kept():
    config = engine_config(None, device="cpu", speculative="mtp", num_speculative_tokens=1)
    assert resolve_auto_speculation(config, ModelFiles(None)) is config


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "auto"),
        (["--no-speculative"], None),
        (["--speculative", "none"], None),
        (["--speculative", "mtp"], "mtp"),
    ],
)
def test_the_command_line_asks_for_auto_unless_told(argv, expected):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_kwargs(parser.parse_args(argv))["speculative"] == expected
