"""Comparisons of two runs' outputs that the MTP tests share."""

from __future__ import annotations

LOGPROB_TOLERANCE = 1e-4


def assert_same_logprobs(got, want, ranks: bool = False) -> None:
    """Two RequestOutputs' sampled-token logprobs: the same entries (tokens, and with
    ``ranks`` their ranks) at every position, each logprob within ``LOGPROB_TOLERANCE``."""
    got_logprobs = got.outputs[0].logprobs or []
    want_logprobs = want.outputs[0].logprobs or []
    assert len(got_logprobs) == len(want_logprobs)
    for got_entry, want_entry in zip(got_logprobs, want_logprobs, strict=True):
        assert got_entry.keys() == want_entry.keys()
        for token, entry in want_entry.items():
            assert abs(got_entry[token].logprob - entry.logprob) < LOGPROB_TOLERANCE
            if ranks:
                assert got_entry[token].rank == entry.rank
