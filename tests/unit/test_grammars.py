"""The grammar book without an engine: bitmasks decoded to token sets, the end of a complete
output allowing exactly the model's end tokens (ours, not xgrammar's guess from the
tokenizer, which changed with the transformers version), and the masks of a row with drafts
(a forbidden draft ends them; the matcher ends where it began)."""

from __future__ import annotations

import pytest
import torch

from tandem.models.loader import default_model_path
from tandem.tokenizer import Tokenizer
from tandem.worker.grammars import GrammarBook, advance, allowed_tokens


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    try:
        return Tokenizer.from_model_path(default_model_path())
    except ValueError as e:  # the default model's package is not installed
        pytest.skip(str(e))


def allowed(book: GrammarBook, masks: torch.Tensor, row: int) -> set[int]:
    return set(
        allowed_tokens(masks[row : row + 1], book.vocab_size)[0].nonzero().flatten().tolist()
    )


def test_bits_are_tokens():
    vocab = 70
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    for token in (0, 31, 32, 63, 69):
        word, bit = divmod(token, 32)
        bitmask[0, word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
    got = allowed_tokens(bitmask, vocab)[0].nonzero().flatten().tolist()
    assert got == [0, 31, 32, 63, 69]


@pytest.mark.parametrize("end_ids", ["model", [7]])
def test_a_complete_output_may_only_end_with_the_given_end_tokens(tokenizer, end_ids):
    if end_ids == "model":
        end_ids = sorted(tokenizer.end_token_ids)
    book = GrammarBook(tokenizer.hf, tokenizer.vocab_size, end_ids)
    matcher = book.matcher({"choice": ["yes"]}, tokenizer.encode("yes", add_special_tokens=False))
    masks = book.masks(matcher, [])
    assert allowed(book, masks, 0) == set(end_ids)
    advance(matcher, [end_ids[0]])
    assert matcher.is_terminated()
    assert allowed(book, book.masks(matcher, []), 0) == set(end_ids)


def test_masks_of_a_row_with_drafts(tokenizer):
    book = GrammarBook.of(tokenizer, tokenizer.vocab_size)
    (red,) = tokenizer.encode("red", add_special_tokens=False)
    (blue,) = tokenizer.encode("blue", add_special_tokens=False)
    matcher = book.matcher({"choice": ["red", "blue"]}, [])
    # The first draft is allowed, the second (after a complete choice) is not an end token.
    masks = book.masks(matcher, [red, blue, blue])
    assert {red, blue} <= allowed(book, masks, 0)
    assert allowed(book, masks, 1) == set(tokenizer.end_token_ids)
    full = (1 << 32) - 1
    assert (masks[2].to(torch.int64) & full == full).all()  # decides nothing: all allowed
    # The matcher ends where it began: the next masks are the first's again.
    assert torch.equal(book.masks(matcher, [])[0], masks[0])
