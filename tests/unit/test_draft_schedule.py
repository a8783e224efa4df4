"""The draft schedule (fewer drafts for larger batches): its configuration, the command
line, the step-graph shapes it needs, and the slot kernels verifying fewer drafts than a
slot holds (the engine runs: tests/e2e/test_mtp_draft_schedule.py)."""

from __future__ import annotations

import argparse

import pytest
import torch

from tandem.config import SpeculativeConfig
from tandem.engine_options import add_engine_arguments, draft_schedule, engine_kwargs
from tandem.llm import engine_config
from tandem.models.mtp import resolve_auto_speculation
from tandem.worker.request_slots import RequestSlots
from tandem.worker.spec_decode.slot_rows import accept, verify_rows
from tandem.worker.spec_decode.step_graphs import step_shapes

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_a_step_verifies_the_drafts_of_the_largest_batch_size_it_reaches():
    spec = SpeculativeConfig("mtp", 3, draft_schedule=((8, 2), (32, 1)))
    assert [spec.drafts_for(n) for n in (1, 7, 8, 31, 32, 64)] == [3, 3, 2, 2, 1, 1]
    assert SpeculativeConfig("mtp", 3).drafts_for(64) == 3


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (((32, 1), (8, 2)), "ascending"),
        (((8, 2), (8, 1)), "ascending"),
        (((0, 2),), ">= 1"),
        (((8, 4),), r"\[1, num_speculative_tokens = 3\]"),
        (((8, 0),), r"\[1, num_speculative_tokens = 3\]"),
        (((8,),), "pairs"),
        ((("x", 1),), "pairs"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_problem(schedule, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig("mtp", 3, draft_schedule=schedule)


def test_a_schedule_without_speculation_is_refused_and_auto_off_drops_it():
    with pytest.raises(ValueError, match="needs speculative decoding"):
        SpeculativeConfig(None, 0, draft_schedule=((8, 1),))
    # Off in the engine config: no method, no schedule.
    assert engine_config(speculative_draft_schedule=((8, 1),)).speculative.draft_schedule == ()
    config = engine_config(speculative="auto", speculative_draft_schedule=((8, 1),))
    assert config.speculative.draft_schedule == ((8, 1),)
    resolved = resolve_auto_speculation(config, None).speculative  # on the CPU: off
    assert (resolved.method, resolved.draft_schedule) == (None, ())


def test_the_command_line_takes_rows_colon_drafts_pairs():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-draft-schedule", "32:2, 64:1"])
    assert engine_kwargs(args)["speculative_draft_schedule"] == ((32, 2), (64, 1))
    assert engine_kwargs(parser.parse_args([]))["speculative_draft_schedule"] == ()
    for bad in ("32", "32:x", "a:1", "32:-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="ROWS:DRAFTS"):
            draft_schedule(bad)


def test_step_graph_shapes_cover_every_verified_and_drafted_pair():
    spec = SpeculativeConfig("mtp", 3)
    assert step_shapes(spec, [1, 2, 4]) == {1: [(3, 3)], 2: [(3, 3)], 4: [(3, 3)]}
    spec = SpeculativeConfig("mtp", 3, draft_schedule=((3, 2), (6, 1)))
    # Size 4 holds steps of 3 and 4 rows (both draft 2), size 8 those of 5 to 8 rows (5
    # drafts 2, 6 and more draft 1); a step verifies what it drafts or less (a slot that a
    # larger step drafted before holds fewer).
    assert step_shapes(spec, [1, 2, 4, 8, 16]) == {
        1: [(1, 3), (2, 3), (3, 3)],
        2: [(1, 3), (2, 3), (3, 3)],
        4: [(1, 2), (2, 2)],
        8: [(1, 1), (1, 2), (2, 2)],
        16: [(1, 1)],
    }


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "kernel"])
def test_rows_verify_the_first_drafts_of_their_slots(use_triton):
    """A slot holding three drafts, verified one deep: the row's tokens are the last token
    and the first draft, and greedy acceptance of that one moves the slot on by at most
    two positions."""
    slots = RequestSlots(3, 100, DEVICE, capacity=4)
    slots.next_start[1], slots.last_token[1] = 5, 7
    slots.drafts[1] = torch.tensor([11, 12, 13])
    slot_ids = torch.tensor([1], device=DEVICE)
    tables = torch.tensor([[4, 5]], dtype=torch.int32, device=DEVICE)
    rows = verify_rows(slots, slot_ids, tables, 4, 99, use_triton, num_drafts=1)
    assert rows.input_ids.tolist() == [7, 11]
    assert rows.positions.tolist() == [5, 6]
    assert rows.slot_mapping.tolist() == [5 * 4 + 1, 5 * 4 + 2]
    assert rows.seq_lens.tolist() == [7]
    # The target agrees with the draft (11) and would say 20 after it: 2 tokens, next start
    # 7 with 20 as its last token (the slot's drafts 12 and 13 are never looked at).
    out = accept(slots, slot_ids, rows, torch.tensor([11, 20], device=DEVICE), None, use_triton)
    assert (out.emitted.tolist(), out.kept.tolist(), out.last_positions.tolist()) == ([2], [1], [6])
    assert (int(slots.next_start[1]), int(slots.last_token[1])) == (7, 20)
