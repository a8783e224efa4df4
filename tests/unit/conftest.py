"""Fixtures of the unit tests."""

import pytest

from tandem.tokenizer import Tokenizer


@pytest.fixture
def tokenizer_loaded_once(monkeypatch):
    """Engines built one after the other in a test (one per mode of a bench) load their
    tokenizer once per model path, not once per engine."""
    loaded: dict[str, Tokenizer] = {}
    load = Tokenizer.from_model_path
    monkeypatch.setattr(
        Tokenizer,
        "from_model_path",
        staticmethod(lambda path: loaded.get(path) or loaded.setdefault(path, load(path))),
    )
