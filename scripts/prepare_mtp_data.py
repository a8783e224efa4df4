"""Tokenize the MTP training data here (ShareGPT is too large to carry to the GPU machine).

Usage: prepare_mtp_data.py OUT.pt NUM_CONVERSATIONS NUM_PROMPTS [NUM_LATER_PROMPTS
                           [FROM_FIRST FROM_LATER]]

Writes {"sequences": the first NUM_CONVERSATIONS chat-templated ShareGPT conversations,
"self_prompts": first user turns (ending with the assistant header) whose replies the base
model writes itself on the GPU}, as lists of token ids, all from the records before the
benchmarks' held-out index. The prompts are the first turns of every usable conversation,
the NUM_CONVERSATIONS included (the model's own reply beside ChatGPT's), up to NUM_PROMPTS;
then up to NUM_LATER_PROMPTS users' later turns, each with as much of its conversation before
it as fits in 512 tokens (``later_turn_prompts``): replies that follow a conversation.
FROM_FIRST and FROM_LATER keep only the prompts from those indices on (the base's replies to
the ones before were written in an earlier run: 5138 16000 after ``12000 6000 16000``)."""

import sys

import torch

from tandem.models.loader import resolve_model
from tandem.tokenizer import Tokenizer
from tandem.train.mtp_data import (
    first_assistant_start,
    later_turn_prompts,
    sharegpt_sequences,
    training_records,
)

out, num_conversations, num_prompts, seq_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), 256
num_later = int(sys.argv[4]) if len(sys.argv) > 4 else 0
from_first, from_later = (int(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 6 else (0, 0)
tokenizer = Tokenizer.from_model_path(resolve_model(None))
sequences = sharegpt_sequences(tokenizer, max(num_conversations, num_prompts), seq_len)
prompts = []
for ids in sequences[:num_prompts]:
    end = first_assistant_start(tokenizer, ids)
    if end:
        prompts.append(ids[:end])
later = later_turn_prompts(tokenizer, training_records(), num_later, 512) if num_later else []
prompts, later = prompts[from_first:], later[from_later:]
data = {"sequences": sequences[:num_conversations], "self_prompts": prompts + later}
torch.save(data, out)
print(
    f"{len(data['sequences'])} conversations, {len(prompts)} first-turn and {len(later)} "
    f"later-turn prompts -> {out}"
)
