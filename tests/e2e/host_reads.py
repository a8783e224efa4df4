"""Counts the host's reads of tensor values outside the one place meant for them (the
DeviceReader), for the one-wait-per-step tests: ``counted`` wraps a step function so that,
while it runs, every ``.tolist()``, ``.item()``, ``bool(t)``, ... in the main thread outside
``DeviceReader.read_all`` / ``take`` is recorded with its caller, and the reader's waits per
call are listed."""

from __future__ import annotations

import threading
import traceback
from collections import Counter

import pytest
import torch

from tandem.device_copy import DeviceReader

HOST_READS = ("tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class HostReads:
    """``stray``: reads outside the readers, by "name at file:line"; ``waits``: the reader's
    waits during each counted call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.monkeypatch = monkeypatch
        self.stray: Counter = Counter()
        self.waits: list[int] = []
        self._inside = threading.Event()
        self._main = threading.current_thread()
        # A read of copies that have completed (no wait) is the reader's too.
        monkeypatch.setattr(DeviceReader, "take", staticmethod(self._marked(DeviceReader.take)))

    def _marked(self, read):
        def marked(*args):
            self._inside.set()
            try:
                return read(*args)
            finally:
                self._inside.clear()

        return marked

    def _counting(self, name: str):
        original = getattr(torch.Tensor, name)

        def wrapper(tensor, *args, **kwargs):
            if not self._inside.is_set() and threading.current_thread() is self._main:
                caller = traceback.extract_stack(limit=2)[0]
                self.stray[f"{name} at {caller.filename}:{caller.lineno}"] += 1
            return original(tensor, *args, **kwargs)

        return wrapper

    def counted(self, step, reader: DeviceReader):
        """``step`` (a no-argument or one-argument call), counted against ``reader``."""
        self.monkeypatch.setattr(reader, "read_all", self._marked(reader.read_all))

        def run(*args):
            before = reader.num_waits
            try:
                with pytest.MonkeyPatch.context() as patch:
                    for name in HOST_READS:
                        patch.setattr(torch.Tensor, name, self._counting(name))
                    return step(*args)
            finally:
                self.waits.append(reader.num_waits - before)

        return run
