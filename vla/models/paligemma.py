"""PaliGemma building blocks shared by both policies: transformers configs, the prefix embedder, buffers.

The prefix is what PaliGemma reads before it writes anything: each camera image through SigLIP and a
linear projector to the Gemma width, followed by the prompt's token embeddings (scaled by sqrt(width),
as Gemma does). Both policies then run Gemma decoder layers over it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from transformers import GemmaConfig, SiglipVisionConfig, SiglipVisionModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.gemma.modeling_gemma import GemmaRotaryEmbedding, GemmaTextScaledWordEmbedding
from transformers.models.siglip.modeling_siglip import SiglipVisionEmbeddings

from vla.models.config import GemmaSpec, SiglipSpec
from vla.types import Observation

# Decoder layers get an explicit mask; SDPA takes a boolean one and runs on every backend.
ATTENTION_IMPLEMENTATION = "sdpa"
# The pad token id of PaliGemma's tokenizer and of vla.data.tokenizer (see PaliGemmaEmbedder).
PAD_TOKEN_ID = 0


def gemma_config(spec: GemmaSpec, *, vocab_size: int, rope_theta: float, rms_norm_eps: float) -> GemmaConfig:
    """transformers GemmaConfig for one decoder stack of the given size."""
    config = GemmaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.width,
        intermediate_size=spec.mlp_dim,
        num_hidden_layers=spec.depth,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        hidden_act="gelu_pytorch_tanh",
        rms_norm_eps=rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        attention_dropout=0.0,
    )
    config._attn_implementation = ATTENTION_IMPLEMENTATION
    return config


def siglip_config(spec: SiglipSpec) -> SiglipVisionConfig:
    """transformers SiglipVisionConfig as PaliGemma uses it: no pooling head, patch tokens out."""
    config = SiglipVisionConfig(
        hidden_size=spec.width,
        intermediate_size=spec.mlp_dim,
        num_hidden_layers=spec.depth,
        num_attention_heads=spec.num_heads,
        num_channels=3,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6,
        attention_dropout=0.0,
        vision_use_head=False,
    )
    config._attn_implementation = ATTENTION_IMPLEMENTATION
    return config


class PaliGemmaEmbedder(nn.Module):
    """Observation -> prefix token embeddings: SigLIP -> multi_modal_projector per camera, then the prompt.

    Parameters: `vision_tower` (transformers SiglipVisionModel), `multi_modal_projector` (Linear vision
    width -> Gemma width), `embed_tokens` (Gemma's token embedding, multiplied by sqrt(width) on lookup).
    """

    def __init__(self, vision: SiglipSpec, width: int, vocab_size: int) -> None:
        super().__init__()
        self.vision_spec = vision
        self.vision_tower = SiglipVisionModel(siglip_config(vision))
        self.multi_modal_projector = nn.Linear(vision.width, width)
        # Token 0 is the pad token (PaliGemma's and our tokenizers'): as in transformers' Gemma
        # (padding_idx = pad_token_id = 0), its row gets no gradient from the lookup and starts at zero.
        self.embed_tokens = GemmaTextScaledWordEmbedding(
            vocab_size, width, padding_idx=PAD_TOKEN_ID, embed_scale=width**0.5
        )
        # Unit-RMS token vectors after the sqrt(width) scale, like the projected (LayerNormed) image tokens.
        nn.init.normal_(self.embed_tokens.weight, std=width**-0.5)
        with torch.no_grad():
            self.embed_tokens.weight[PAD_TOKEN_ID].zero_()

    def forward(self, observation: Observation, cameras: tuple[str, ...]) -> tuple[Tensor, Tensor]:
        """Embed the prefix.

        Returns:
            embeddings: (B, P, W) with P = len(cameras) * tokens_per_image + L, in the dtype of embed_tokens.
            pad_mask: (B, P) bool; False on every token of a missing camera and on prompt padding.
        """
        batch = observation.batch_size
        pixels = torch.cat([observation.images[camera] for camera in cameras], dim=0)
        patch_tokens = self.vision_tower(pixel_values=pixels).last_hidden_state
        image_tokens = self.multi_modal_projector(patch_tokens)
        tokens_per_image, width = image_tokens.shape[1], image_tokens.shape[2]
        # (cameras * B, T, W) -> (B, cameras * T, W), camera-major within each sample.
        image_tokens = image_tokens.view(len(cameras), batch, tokens_per_image, width).transpose(0, 1)
        image_tokens = image_tokens.reshape(batch, len(cameras) * tokens_per_image, width)
        image_pad = torch.cat(
            [observation.image_masks[c].bool()[:, None].expand(batch, tokens_per_image) for c in cameras],
            dim=1,
        )
        text_tokens = self.embed_tokens(observation.tokenized_prompt)
        embeddings = torch.cat([image_tokens.to(text_tokens.dtype), text_tokens], dim=1)
        pad_mask = torch.cat([image_pad, observation.tokenized_prompt_mask.bool()], dim=1)
        return embeddings, pad_mask

    def vision_layers(self) -> list[nn.Module]:
        return list(self.vision_tower.encoder.layers)


def set_layer_checkpointing(layers: Iterable[nn.Module], enabled: bool) -> None:
    """Turn activation checkpointing of transformers-style layers on or off.

    Uses GradientCheckpointingLayer's documented switch (`gradient_checkpointing` plus the checkpoint
    function). The layer checkpoints its own `forward`, so module hooks such as FSDP2's stay outside the
    recomputed region and do not fire twice.
    """
    checkpoint_fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    for layer in layers:
        if not isinstance(layer, GradientCheckpointingLayer):
            raise TypeError(f"{type(layer).__name__} is not a GradientCheckpointingLayer")
        layer.gradient_checkpointing = enabled
        layer._gradient_checkpointing_func = checkpoint_fn


@torch.no_grad()
def init_non_persistent_buffers(module: nn.Module) -> None:
    """Recompute the buffers that state dicts do not carry (RoPE frequencies, embedding scale, patch ids).

    Needed after building on the meta device and materialising with `to_empty()`: parameters then come
    from a checkpoint, but these buffers would hold uninitialised memory.
    """
    for sub in module.modules():
        if isinstance(sub, GemmaRotaryEmbedding):
            if sub.rope_type != "default":
                raise ValueError(
                    f"cannot re-initialise RoPE of type {sub.rope_type!r}; only 'default' is built"
                )
            inv_freq, _ = sub.compute_default_rope_parameters(sub.config)
            sub.inv_freq.copy_(inv_freq)
            sub.original_inv_freq.copy_(inv_freq)
        elif isinstance(sub, GemmaTextScaledWordEmbedding):
            sub.embed_scale.fill_(sub.scalar_embed_scale)
        elif isinstance(sub, SiglipVisionEmbeddings):
            sub.position_ids.copy_(torch.arange(sub.num_positions).expand(1, -1))
