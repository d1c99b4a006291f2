"""OpenVLA-style policy: PaliGemma writes the action chunk as text, one bin token per real dim per step.

Sequence: [camera tokens | prompt tokens] (prefix, bidirectional) then the H * D action tokens (causal),
where D is the number of real action dims. Training is teacher-forced cross-entropy on the action tokens
only; `sample_actions` decodes the chunk greedily with a KV cache. The LM head is the token embedding
(tied, as in PaliGemma). The robot state is not an input, as in OpenVLA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache
from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer, GemmaRMSNorm, GemmaRotaryEmbedding

from vla.models.action_tokenizer import ActionTokenizer
from vla.models.base import PaliGemmaPolicyBase
from vla.models.config import OpenVLAConfig
from vla.models.contract import as_observation, check_batch, check_observation
from vla.models.losses import per_sample_masked_mean
from vla.models.masks import make_attention_mask, positions_from_pad_mask
from vla.models.paligemma import PaliGemmaEmbedder, gemma_config
from vla.types import Batch, Observation


def _last_real_index(pad_mask: Tensor) -> Tensor:
    """(B, N) bool -> (B,) index of the last True (0 when a row has none)."""
    index = torch.arange(pad_mask.shape[1], device=pad_mask.device)[None, :]
    return torch.where(pad_mask, index, -1).amax(dim=1).clamp_min(0)


class OpenVLAPolicy(PaliGemmaPolicyBase):
    """OpenVLA-style discrete-action policy on PaliGemma.

    Parameters: prefix_embedder.{vision_tower, multi_modal_projector, embed_tokens} (embed_tokens is also
    the LM head), layers[i] (Gemma decoder layers), norm (final RMSNorm).
    """

    def __init__(self, config: OpenVLAConfig) -> None:
        super().__init__()
        if not isinstance(config, OpenVLAConfig):
            raise TypeError(f"OpenVLAPolicy needs an OpenVLAConfig, got {type(config).__name__}")
        self.config = config
        self.gemma_config = gemma_config(
            config.vlm,
            vocab_size=config.vocab_size,
            rope_theta=config.rope_theta,
            rms_norm_eps=config.rms_norm_eps,
        )
        self.prefix_embedder = PaliGemmaEmbedder(config.vision, config.vlm.width, config.vocab_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(self.gemma_config, i) for i in range(config.vlm.depth))
        self.norm = GemmaRMSNorm(config.vlm.width, eps=config.rms_norm_eps)
        self.rotary_emb = GemmaRotaryEmbedding(self.gemma_config)
        self.action_tokenizer = ActionTokenizer(
            vocab_size=config.vocab_size,
            num_bins=config.num_action_bins,
            reserved_tail_tokens=config.reserved_tail_tokens,
        )
        if config.freeze_vision_tower:
            self.prefix_embedder.vision_tower.requires_grad_(False)
        self.set_gradient_checkpointing(config.gradient_checkpointing)

    # ----------------------------------------------------------------------------------------- contract
    def compute_loss(
        self, batch: Batch, *, noise: Tensor | None = None, time: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Cross-entropy on the action tokens of non-pad steps (teacher forcing).

        Returns:
            loss (scalar) and metrics {"loss", "token_accuracy", "l1"}: the prediction at each token is the
            argmax over the action-bin ids (what `sample_actions` would pick given the true history);
            l1 is the mean |decoded prediction - action| over real dims of non-pad steps.
        """
        if noise is not None or time is not None:
            raise ValueError(
                "the OpenVLA-style policy is not a flow model: compute_loss takes no noise or time"
            )
        config = self.config
        check_batch(batch, config, text_token_limit=config.first_action_token_id)
        dims = self._real_dims(batch)
        actions = batch.actions[:, :, dims]  # (B, H, D)
        b, h, d = actions.shape
        targets = self.action_tokenizer.encode(actions).flatten(1)  # (B, T), step-major
        num_tokens = targets.shape[1]

        prefix, prefix_pad = self.prefix_embedder(batch.observation, config.cameras)
        prefix_len = prefix.shape[1]
        action_embeddings = self.prefix_embedder.embed_tokens(targets).to(prefix.dtype)
        hidden = torch.cat([prefix, action_embeddings], dim=1)
        pad_mask = torch.cat([prefix_pad, torch.ones_like(targets, dtype=torch.bool)], dim=1)
        ar_mask = torch.cat(
            [
                torch.zeros(prefix_len, dtype=torch.bool, device=hidden.device),
                torch.ones(num_tokens, dtype=torch.bool, device=hidden.device),
            ]
        )
        attention_mask = make_attention_mask(pad_mask, ar_mask)[:, None]
        hidden = self._decoder(hidden, attention_mask, positions_from_pad_mask(pad_mask))

        # Token k is predicted from the token before it: the last real prefix token for k = 0 (the prompt
        # is right-padded, so that is not always position P - 1), action token k - 1 after that.
        previous = prefix_len + torch.arange(num_tokens - 1, device=hidden.device)[None, :].expand(b, -1)
        predictor_index = torch.cat([_last_real_index(prefix_pad)[:, None], previous], dim=1)
        predictor_hidden = hidden.gather(1, predictor_index[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = self._logits(predictor_hidden)  # (B, T, V)

        token_weights = (~batch.action_is_pad.bool()).repeat_interleave(d, dim=1).to(logits.dtype)
        cross_entropy = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        loss = per_sample_masked_mean(cross_entropy.view(b, num_tokens), token_weights)
        with torch.no_grad():
            predicted = self._greedy_action_tokens(logits)
            accuracy = per_sample_masked_mean((predicted == targets).to(logits.dtype), token_weights)
            decoded = self.action_tokenizer.decode(predicted).view(b, h, d)
            l1 = per_sample_masked_mean((decoded - actions.float()).abs().flatten(1), token_weights)
        return loss, {"loss": loss.detach(), "token_accuracy": accuracy, "l1": l1}

    @torch.no_grad()
    def sample_actions(
        self, observation: Observation | Batch, *, noise: Tensor | None = None, num_steps: int | None = None
    ) -> Tensor:
        """Greedy decoding of the whole chunk -> actions (B, H, max_action_dim), zeros in non-real dims.

        Real dims come from the Batch's action_dim_mask when a Batch is given, else from
        config.action_dim. Each step picks the most likely of the action-bin ids.
        """
        if noise is not None or num_steps is not None:
            raise ValueError(
                "the OpenVLA-style policy decodes greedily: sample_actions takes no noise or num_steps"
            )
        config = self.config
        dims = self._real_dims(observation if isinstance(observation, Batch) else None)
        observation = as_observation(observation)
        check_observation(observation, config, text_token_limit=config.first_action_token_id)
        b = observation.batch_size
        num_tokens = config.action_horizon * len(dims)

        prefix, prefix_pad = self.prefix_embedder(observation, config.cameras)
        cache = DynamicCache(config=self.gemma_config)
        no_blocks = torch.zeros(prefix.shape[1], dtype=torch.bool, device=prefix.device)
        hidden = self._decoder(
            prefix,
            make_attention_mask(prefix_pad, no_blocks)[:, None],
            positions_from_pad_mask(prefix_pad),
            cache,
        )
        last_hidden = hidden[torch.arange(b, device=hidden.device), _last_real_index(prefix_pad)][:, None]
        num_real = prefix_pad.sum(dim=1)
        key_pad = prefix_pad
        tokens: list[Tensor] = []
        for k in range(num_tokens):
            token = self._greedy_action_tokens(self._logits(last_hidden))  # (B, 1)
            tokens.append(token)
            if k == num_tokens - 1:
                break
            key_pad = torch.cat([key_pad, torch.ones(b, 1, dtype=torch.bool, device=key_pad.device)], dim=1)
            embedded = self.prefix_embedder.embed_tokens(token).to(prefix.dtype)
            last_hidden = self._decoder(embedded, key_pad[:, None, None, :], (num_real + k)[:, None], cache)

        decoded = self.action_tokenizer.decode(torch.cat(tokens, dim=1)).view(
            b, config.action_horizon, len(dims)
        )
        actions = torch.zeros(b, config.action_horizon, config.max_action_dim, device=decoded.device)
        actions[:, :, dims] = decoded
        return actions

    # ------------------------------------------------------------------------------------------ helpers
    def _decoder(
        self, hidden: Tensor, attention_mask: Tensor, positions: Tensor, cache: DynamicCache | None = None
    ) -> Tensor:
        """Gemma decoder layers over `hidden` (B, N, W); mask (B, 1, N, N_keys) bool; positions (B, N)."""
        position_embeddings = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(
                hidden, attention_mask=attention_mask, position_embeddings=position_embeddings, cache=cache
            )
        return hidden

    def _logits(self, hidden: Tensor) -> Tensor:
        """Final norm + tied LM head -> float32 logits over the whole vocabulary."""
        return F.linear(self.norm(hidden), self.prefix_embedder.embed_tokens.weight).float()

    def _greedy_action_tokens(self, logits: Tensor) -> Tensor:
        """Argmax restricted to the action-bin ids, as token ids (shape of logits without the vocab dim)."""
        first = self.action_tokenizer.first_token_id
        return logits[..., first : first + self.action_tokenizer.num_bins].argmax(dim=-1) + first

    def _real_dims(self, batch: Batch | None) -> Tensor:
        """Indices (D,) of the real action dims, shared by the whole batch."""
        action_dim = self.config.action_dim
        if batch is None:
            if action_dim is None:
                raise ValueError(
                    "OpenVLA-style sample_actions on a bare Observation needs OpenVLAConfig.action_dim "
                    "(the number of real action dims): set it in the config, or pass the Batch"
                )
            return torch.arange(action_dim)
        mask = batch.action_dim_mask.bool()
        if not bool((mask == mask[:1]).all()):
            raise ValueError(
                "batch.action_dim_mask differs between samples; the OpenVLA-style policy writes a fixed "
                "number of tokens per step, so batch samples of one dataset (one action layout) together"
            )
        dims = mask[0].nonzero().flatten().cpu()
        if dims.numel() == 0:
            raise ValueError("batch.action_dim_mask has no real action dim (all False)")
        if action_dim is not None and not torch.equal(dims, torch.arange(action_dim)):
            raise ValueError(
                f"batch.action_dim_mask marks dims {dims.tolist()} but OpenVLAConfig.action_dim={action_dim} "
                f"expects the first {action_dim}"
            )
        return dims
