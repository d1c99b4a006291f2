"""One pi0 layer pair: VLM decoder layer i and action-expert decoder layer i joined by one attention.

Each stream keeps its own weights (transformers GemmaDecoderLayer modules: norms, q/k/v/o projections, MLP).
Per layer both streams compute their queries, keys and values, the two sequences are concatenated for a
single attention, and the result is split back for each stream's o_proj and MLP. The pair is one
nn.Module whose own `forward` reads both layers' weights, so it is the unit to wrap with FSDP2
(wrapping one stream's layer alone would never fire its hooks) and to checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GemmaConfig
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer, apply_rotary_pos_emb


@dataclass
class LayerKV:
    """Keys (after RoPE) and values of the prefix tokens of one layer: each (B, num_kv_heads, P, head_dim)."""

    key: Tensor
    value: Tensor


def _heads(projection: nn.Linear, hidden: Tensor, head_dim: int) -> Tensor:
    """(B, N, width) -> (B, heads, N, head_dim) through a q/k/v projection."""
    out = projection(hidden)
    return out.view(*hidden.shape[:-1], -1, head_dim).transpose(1, 2)


class JointDecoderLayer(GradientCheckpointingLayer):
    """VLM layer `vlm` and expert layer `expert` (both GemmaDecoderLayer) with joint attention.

    `prefix_output_used=False` marks the last pair: nothing downstream reads the prefix stream's output
    there (only the action tokens feed the loss), so its queries, o_proj, post-attention norm and MLP are
    never computed. Those weights stay as parameters so checkpoints load, but are frozen: they can get no
    gradient, and DDP requires every trainable parameter to get one.
    """

    def __init__(
        self, vlm_config: GemmaConfig, expert_config: GemmaConfig, layer_idx: int, *, prefix_output_used: bool
    ) -> None:
        super().__init__()
        self.vlm = GemmaDecoderLayer(vlm_config, layer_idx)
        self.expert = GemmaDecoderLayer(expert_config, layer_idx)
        self.layer_idx = layer_idx
        self.prefix_output_used = prefix_output_used
        self.head_dim = vlm_config.head_dim
        self.scaling = self.vlm.self_attn.scaling
        if not prefix_output_used:
            for module in (
                self.vlm.self_attn.q_proj,
                self.vlm.self_attn.o_proj,
                self.vlm.post_attention_layernorm,
                self.vlm.mlp,
            ):
                module.requires_grad_(False)

    def forward(
        self,
        prefix: Tensor | None,
        suffix: Tensor | None,
        *,
        cos: Tensor,
        sin: Tensor,
        attention_mask: Tensor,
        past_prefix: LayerKV | None = None,
        return_prefix_kv: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, LayerKV | None]:
        """Run the pair on whichever streams are given.

        Args:
            prefix: (B, P, W_vlm) prefix hidden states, or None (suffix-only step against `past_prefix`).
            suffix: (B, S, W_expert) suffix hidden states, or None (prefix-only pass that fills a cache).
            cos, sin: (B, N_new, head_dim) RoPE tables for the new tokens (prefix then suffix).
            attention_mask: (B, 1, N_new, N_keys) bool, True = may attend. Keys are the cached prefix (if
                any) followed by the new tokens; rows are the new tokens in the same order.
            past_prefix: cached prefix keys/values of this layer; only with prefix=None.
            return_prefix_kv: return this layer's prefix keys/values (to fill a cache). Off in training:
                they are views, and FSDP2 hooks every tensor a wrapped module returns.

        Returns:
            (prefix_out or None, suffix_out or None, this layer's prefix LayerKV or None). prefix_out is None
            when no prefix was given or when this is the last pair.
        """
        if prefix is None and suffix is None:
            raise ValueError("JointDecoderLayer needs a prefix, a suffix, or both")
        if past_prefix is not None and prefix is not None:
            raise ValueError("past_prefix replaces the prefix stream; pass prefix=None with it")

        streams: list[tuple[GemmaDecoderLayer, Tensor, bool]] = []
        if prefix is not None:
            streams.append((self.vlm, prefix, self.prefix_output_used))
        if suffix is not None:
            streams.append((self.expert, suffix, True))

        queries, keys, values = [], [], []
        start = 0
        for layer, hidden, needs_output in streams:
            end = start + hidden.shape[1]
            normed = layer.input_layernorm(hidden)
            key = _heads(layer.self_attn.k_proj, normed, self.head_dim)
            value = _heads(layer.self_attn.v_proj, normed, self.head_dim)
            stream_cos, stream_sin = cos[:, start:end].to(key.dtype), sin[:, start:end].to(key.dtype)
            if needs_output:
                query = _heads(layer.self_attn.q_proj, normed, self.head_dim)
                query, key = apply_rotary_pos_emb(query, key, stream_cos, stream_sin)
                queries.append(query)
            else:
                # Keys only: this stream's queries would feed nothing downstream.
                _, key = apply_rotary_pos_emb(key, key, stream_cos, stream_sin)
            keys.append(key)
            values.append(value)
            start = end

        new_prefix_kv = LayerKV(keys[0], values[0]) if prefix is not None and return_prefix_kv else None
        output_streams = [(layer, hidden) for layer, hidden, needs_output in streams if needs_output]
        if not output_streams:
            return None, None, new_prefix_kv

        if past_prefix is not None:
            keys.insert(0, past_prefix.key)
            values.insert(0, past_prefix.value)
        query = torch.cat(queries, dim=2)
        key = torch.cat(keys, dim=2).to(query.dtype)
        value = torch.cat(values, dim=2).to(query.dtype)
        mask = attention_mask
        if prefix is not None and not self.prefix_output_used:
            mask = attention_mask[:, :, prefix.shape[1] :]  # drop the rows of the prefix queries we skipped
        attended = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=self.scaling, enable_gqa=query.shape[1] != key.shape[1]
        )
        attended = attended.transpose(1, 2).flatten(2)  # (B, N_queries, heads * head_dim)

        outputs: list[Tensor] = []
        start = 0
        for layer, hidden in output_streams:
            end = start + hidden.shape[1]
            hidden = hidden + layer.self_attn.o_proj(attended[:, start:end])
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            outputs.append(hidden)
            start = end

        prefix_out = outputs[0] if prefix is not None and self.prefix_output_used else None
        suffix_out = outputs[-1] if suffix is not None else None
        return prefix_out, suffix_out, new_prefix_kv
