"""Training's attention for the draft depths that repeat an MTP head's last layer, arranged as
the engine runs them (what EAGLE-3 calls a training-time test).

Serving, a head of L layers keeps its last layer's KV at every position (the stream), and a
draft chain from the last accepted position P runs depth d >= L at position P + d: its query
sees that layer's KV up to P + L - 1 (the stream; under teacher forcing the last own layer's
rows at P + 1 .. P + L - 1 equal the chain's) and the KV each earlier repeated depth of the
same chain wrote at P + j (L <= j < d). In training, depth d's rows cover positions
[d, T - 2] and row i belongs to the chain from P = i, so row i attends to the last own
layer's rows 0 .. i + L - 1 and to row i of every earlier repeated depth and of its own.
Plain causal attention over a repeated depth's own rows (the older training) lets row i see
that depth's rows at every earlier position instead, which serving never has.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.layers.attention import AttentionBackend, DenseCausalBackend


class RecordingCausalBackend(DenseCausalBackend):
    """Dense causal attention that keeps the keys and values it attended over, each
    [batch, seq_len, kv_heads, head_dim], for the chain depths that read them."""

    keys: torch.Tensor
    values: torch.Tensor

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale):
        shape = (self.batch_size, self.seq_len)
        self.keys, self.values = k.view(*shape, *k.shape[1:]), v.view(*shape, *v.shape[1:])
        return super().forward(q, k, v, k_cache, v_cache, metadata, scale)


class ChainBackend(AttentionBackend):
    """Attention of one repeated draft depth (rows [batch, length]): row i sees the stream's
    rows 0 .. i + stream_offset (``stream_offset`` = the head's layers - 1) and row i of each
    earlier repeated depth and of its own. Keeps its keys and values for later depths."""

    def __init__(
        self,
        batch_size: int,
        length: int,
        stream: RecordingCausalBackend,
        stream_offset: int,
        earlier: list[ChainBackend],
    ):
        self.batch_size, self.length = batch_size, length
        self.stream, self.stream_offset, self.earlier = stream, stream_offset, earlier

    def build_metadata(self, query_lens, seq_lens, block_tables, slot_mapping, block_size, device):
        raise NotImplementedError("ChainBackend needs no metadata")

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale):
        shape = (self.batch_size, self.length)
        self.keys, self.values = k.view(*shape, *k.shape[1:]), v.view(*shape, *v.shape[1:])
        n = self.length
        keys = [self.stream.keys] + [e.keys[:, :n] for e in self.earlier] + [self.keys]
        values = [self.stream.values] + [e.values[:, :n] for e in self.earlier] + [self.values]
        rows = torch.arange(n, device=q.device)
        stream_columns = torch.arange(self.stream.keys.shape[1], device=q.device)
        visible_stream = stream_columns[None, :] <= rows[:, None] + self.stream_offset
        same_row = rows[:, None] == rows[None, :]
        mask = torch.cat([visible_stream] + [same_row] * (len(self.earlier) + 1), dim=1)
        out = F.scaled_dot_product_attention(
            q.view(*shape, *q.shape[1:]).transpose(1, 2),
            torch.cat(keys, dim=1).transpose(1, 2),
            torch.cat(values, dim=1).transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.transpose(1, 2).reshape(q.shape)
