"""``tandem train-mtp``: train an MTP head for a frozen base model by self-distillation.

At position t the head sees the base's final hidden state h[t] and the embedding of token
t+1, and learns the base model's own distribution over token t+2 (KL to the base's logits at
position t+1, as EAGLE trains), not the data set's next token. Data: ShareGPT conversations
under the model's chat template (teacher forcing: one base forward per batch) and responses
the base model generated itself. MT-Bench stays out: it is the evaluation set.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from tandem.layers.attention import DenseCausalBackend
from tandem.models.llama import LlamaModel
from tandem.models.loader import ModelFiles, load_model
from tandem.models.mtp import MTPHead, load_mtp_head, random_head
from tandem.models.mtp_files import head_training_tokens, save_head
from tandem.train.chain_attention import ChainBackend, RecordingCausalBackend


@dataclass
class TrainConfig:
    """Hyper-parameters of one distillation run."""

    steps: int = 2000
    batch_size: int = 32
    seq_len: int = 256
    lr: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.0
    eval_every: int = 200
    seed: int = 0
    # Stop after this many seconds even if fewer than ``steps`` ran; the learning-rate
    # schedule follows whichever of the two budgets is further spent.
    time_budget_s: float | None = None
    # A head directory to continue from (fine-tuning); None starts from the base's last layer.
    init_head: str | None = None
    # MTP layers of a new head; a continued head with fewer grows to it (its new layers start
    # as copies of its last), one with more keeps its own.
    num_layers: int = 1
    # Repeated depths attend as a serving draft chain does (chain_attention.py); False trains
    # them with causal attention over their own rows, as heads before it were trained.
    chain_attention: bool = True
    # The base's distribution is sharpened to softmax(logits / T) before the KL: below 1 the
    # head spends less of its capacity on the base's tail, more on its first choice (what
    # greedy verification accepts).
    teacher_temperature: float = 1.0
    # The base's layers whose residual stream the first draft takes, fused (EAGLE-3's low,
    # middle and high features; the last must be the base's last layer). A continued head
    # without them gets a projection that starts as the head it was.
    feature_layers: tuple[int, ...] = ()


def _base_outputs(model: LlamaModel, tokens: torch.Tensor, layers: tuple[int, ...] = ()):
    """Final hidden states [B, T, H], log-probs [B, T, V] and the residual stream after
    ``layers`` (each [B, T, H]) of the frozen base."""
    batch, seq_len = tokens.shape
    backend = DenseCausalBackend(batch, seq_len)
    positions = torch.arange(seq_len, device=tokens.device).repeat(batch)
    caches = [(None, None)] * len(model.layers)
    with torch.no_grad():
        hidden, states = model.forward_states(
            tokens.view(-1), positions, caches, None, backend, layers
        )
        logprobs = model.compute_logits(hidden).log_softmax(dim=-1)
    states = [state.view(batch, seq_len, -1) for state in states]
    return hidden.view(batch, seq_len, -1), logprobs.view(batch, seq_len, -1), states


DEPTH_WEIGHTS = (1.0, 0.7, 0.5)


def depth_outputs(head, model, tokens, hidden, depths: int, chain: bool = True):
    """The first ``depths`` draft depths' rows over teacher-forced ``tokens`` [B, T] as the
    engine chains them: yields (depth, start, layer, g), g [B, T - 1 - start, H] at
    positions from start; ``hidden`` is the base's final hidden states [B, T, H].

    A depth with a layer of its own (depth < the head's layers) runs at every position q in
    [0, T-2] on the previous layer's output at q-1 (the base's own hidden state at q for
    depth 0; zeros at q = 0) and the token at q+1, as the engine keeps each layer's KV at
    every position; a later depth repeats the last layer at positions [d, T-2] on the
    previous depth's output at q-1, attending as a draft chain does when serving
    (``chain``, see ``chain_attention``) or causally over its own rows (the older training).
    Each depth's row at q predicts the token at q+2.
    """
    batch, seq_len = tokens.shape
    previous, previous_start = hidden, 0  # the previous depth's rows, from this position
    stream, chained = None, []
    for depth in range(depths):
        own_layer = depth < head.num_layers
        start = 0 if own_layer else depth
        length = seq_len - 1 - start
        if length < 1:
            return
        if depth == 0:
            inputs = hidden[:, :length]
        elif own_layer:
            inputs = torch.cat([torch.zeros_like(previous[:, :1]), previous[:, : length - 1]], 1)
        else:
            first = start - 1 - previous_start
            inputs = previous[:, first : first + length]
        if own_layer or not chain:
            backend = RecordingCausalBackend(batch, length)
            stream = backend
        else:
            backend = ChainBackend(batch, length, stream, head.num_layers - 1, list(chained))
            chained.append(backend)
        layer = head.layers[head.layer_for_depth(depth)]
        positions = torch.arange(start, start + length, device=tokens.device).repeat(batch)
        embeds = model.embed_tokens(tokens[:, start + 1 :]).reshape(batch * length, -1)
        g = layer(
            positions,
            embeds.detach(),
            inputs.reshape(batch * length, -1),
            (None, None),
            None,
            backend,
        ).view(batch, length, -1)
        yield depth, start, layer, g
        previous, previous_start = g, start


def distill_loss(
    head,
    model,
    tokens,
    depths: int = len(DEPTH_WEIGHTS),
    chain: bool = True,
    teacher_temperature: float = 1.0,
):
    """KL(base || head) summed over ``depths`` draft depths (weights ``DEPTH_WEIGHTS``), and
    each depth's greedy agreement with the base under teacher forcing (the first is an
    acceptance estimate), with the depths chained as the engine chains drafts
    (``depth_outputs``). The base's distribution is taken at ``teacher_temperature``
    (its log-probs divided by it and normalized again; 1 leaves it as it is)."""
    if not teacher_temperature > 0:
        raise ValueError(f"teacher_temperature must be > 0, got {teacher_temperature}")
    hidden, base_logprobs, states = _base_outputs(model, tokens, head.feature_layers)
    if states:  # what the engine's target hands a head with fused features
        hidden = torch.cat([hidden, head.fuse_features(states)], dim=-1)
    if teacher_temperature != 1.0:
        base_logprobs = (base_logprobs / teacher_temperature).log_softmax(dim=-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    agreements = []
    for depth, start, layer, g in depth_outputs(head, model, tokens, hidden, depths, chain):
        student = model.compute_logits(layer.final_norm(g)).log_softmax(dim=-1)
        teacher = base_logprobs[:, start + 1 :]
        kl = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()
        total = total + DEPTH_WEIGHTS[min(depth, len(DEPTH_WEIGHTS) - 1)] * kl
        agreements.append((student.argmax(-1) == teacher.argmax(-1)).float().mean())
    return total, agreements


def train_mtp(
    model: str | None,
    train_tokens: torch.Tensor,
    eval_tokens: torch.Tensor,
    config: TrainConfig,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    out_dir: str | None = None,
    progress: bool = True,
) -> tuple[MTPHead, dict]:
    """Train a head (``config.num_layers`` layers, or continue ``config.init_head``); returns
    it and a summary (losses, held-out agreement, tokens seen)."""
    if config.steps < 1:
        raise ValueError(f"steps must be at least 1, got {config.steps}")
    torch.manual_seed(config.seed)
    files = ModelFiles(model)
    base = load_model(files, config.seq_len + 8, dtype, torch.device(device), config.seed)
    base.requires_grad_(False)
    if config.init_head is not None:
        head = load_mtp_head(config.init_head, files, base.rotary).to(device, torch.float32)
        if config.num_layers > head.num_layers:
            head.grow(config.num_layers)
    else:
        head = random_head(files.arch, config.num_layers, base.rotary, config.seed).to(device)
        _init_head_from_base(head, base)
    if config.feature_layers and head.feature_layers != tuple(config.feature_layers):
        head.add_feature_projection(tuple(config.feature_layers), base.norm.weight)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    history: list[dict] = []
    generator = torch.Generator().manual_seed(config.seed)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, desc="train-mtp", dynamic_ncols=True)
    start = time.monotonic()
    step = 0
    while True:
        progress = _progress(step, config, time.monotonic() - start)
        if progress >= 1.0:
            break
        step += 1
        lr = config.lr * min(1.0, step / max(config.warmup_steps, 1))
        lr *= 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = lr
        rows = torch.randint(0, train_tokens.shape[0], (config.batch_size,), generator=generator)
        with torch.autocast(
            device_type=torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32
        ):
            loss, agree = distill_loss(
                head,
                base,
                train_tokens[rows].to(device),
                chain=config.chain_attention,
                teacher_temperature=config.teacher_temperature,
            )
        optimizer.zero_grad(set_to_none=True)
        loss.float().backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        last = _progress(step, config, time.monotonic() - start) >= 1.0
        if step % config.eval_every == 0 or last:
            held_out = evaluate(head, base, eval_tokens, config, device, dtype)
            record = {
                "step": step,
                "loss": loss.item(),
                "train_agree": agree[0].item(),
                "eval_agree": held_out[0],
                "eval_agree_depths": held_out,
                "elapsed_s": time.monotonic() - start,
            }
            history.append(record)
            if bar is not None:
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}", held_out=f"{record['eval_agree']:.3f}"
                )
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    summary = {"config": asdict(config), "steps_run": step, "history": history, "model": files.path}
    # Tokens seen, this run's and the continued head's, when that head's count is complete.
    earlier, complete = head_training_tokens(config.init_head) if config.init_head else (0, True)
    if complete:
        summary["total_tokens"] = earlier + step * config.batch_size * config.seq_len
    if out_dir is not None:
        # bf16 keeps the shipped file small; the engine casts it to its own dtype.
        save_head(
            head, out_dir, os.path.basename(files.path), {"training": summary}, dtype=torch.bfloat16
        )
        with open(f"{out_dir}/train_log.json", "w") as f:
            json.dump(summary, f, indent=2)
    return head, summary


def _progress(step: int, config: TrainConfig, elapsed_s: float) -> float:
    """Fraction of the training budget spent: steps, or wall time when that is tighter."""
    progress = step / config.steps
    if config.time_budget_s:
        progress = max(progress, elapsed_s / config.time_budget_s)
    return min(progress, 1.0)


def evaluate(head, base, eval_tokens, config: TrainConfig, device, dtype) -> list[float]:
    """Held-out greedy agreement of each draft depth with the base (teacher-forced: depth d
    given the true earlier tokens); the first is an acceptance estimate."""
    totals, batches = [], 0
    with (
        torch.no_grad(),
        torch.autocast(
            device_type=torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32
        ),
    ):
        for start in range(0, eval_tokens.shape[0], config.batch_size):
            _, agreements = distill_loss(
                head,
                base,
                eval_tokens[start : start + config.batch_size].to(device),
                chain=config.chain_attention,
            )
            values = [float(a) for a in agreements]
            totals = [t + v for t, v in zip(totals or [0.0] * len(values), values, strict=True)]
            batches += 1
    return [t / max(batches, 1) for t in totals]


def _init_head_from_base(head: MTPHead, base: LlamaModel) -> None:
    """Start each head layer's block from one of the base's last decoder layers (the first
    from the last, a good prior) and its projection as 'take the hidden state', so training
    starts from a sensible draft."""
    hidden = base.arch.hidden_size
    with torch.no_grad():
        for index, layer in enumerate(head.layers):
            layer.block.load_state_dict(base.layers[-1 - index].state_dict())
            layer.final_norm.weight.copy_(base.norm.weight)
            layer.eh_proj.weight.zero_()
            layer.eh_proj.weight[:, hidden:].copy_(torch.eye(hidden))
            layer.eh_proj.weight[:, :hidden].copy_(0.1 * torch.eye(hidden))
