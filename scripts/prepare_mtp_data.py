"""Tokenize the MTP training data here (ShareGPT is too large to carry to the GPU machine).

Usage: prepare_mtp_data.py OUT.pt NUM_CONVERSATIONS NUM_PROMPTS

Writes {"sequences": the first NUM_CONVERSATIONS chat-templated ShareGPT conversations,
"self_prompts": first user turns (ending with the assistant header) whose replies the base
model writes itself on the GPU}, as lists of token ids, all from the records before the
benchmarks' held-out index. The prompts are the first turns of every usable conversation,
the NUM_CONVERSATIONS included (the model's own reply beside ChatGPT's), up to NUM_PROMPTS."""

import sys

import torch

from tandem.models.loader import resolve_model
from tandem.tokenizer import Tokenizer
from tandem.train.mtp_data import first_assistant_start, sharegpt_sequences

out, num_conversations, num_prompts, seq_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), 256
tokenizer = Tokenizer.from_model_path(resolve_model(None))
sequences = sharegpt_sequences(tokenizer, max(num_conversations, num_prompts), seq_len)
prompts = []
for ids in sequences[:num_prompts]:
    end = first_assistant_start(tokenizer, ids)
    if end:
        prompts.append(ids[:end])
torch.save({"sequences": sequences[:num_conversations], "self_prompts": prompts}, out)
print(f"{len(sequences[:num_conversations])} conversations, {len(prompts)} prompts -> {out}")
