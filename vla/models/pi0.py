"""pi0: a PaliGemma prefix and a Gemma action expert, joined layer by layer, trained by flow matching.

Sequence: [camera tokens | prompt tokens] (prefix, VLM stream) then [state token | H action tokens]
(suffix, expert stream). Blocks (see masks.py): prefix ar = 0, state ar = 1, actions ar = [1, 0, ...],
so the prefix sees only itself, the state sees the prefix and itself, and actions see everything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm, GemmaRotaryEmbedding

from vla.models.base import PaliGemmaPolicyBase
from vla.models.config import Pi0Config
from vla.models.contract import as_observation, check_batch, check_observation
from vla.models.flow_matching import euler_integrate, sample_flow_time, sinusoidal_time_embedding
from vla.models.joint_gemma import JointDecoderLayer, LayerKV
from vla.models.losses import per_sample_masked_mean
from vla.models.masks import make_attention_mask, positions_from_pad_mask
from vla.models.paligemma import PaliGemmaEmbedder, gemma_config
from vla.types import Batch, Observation


@dataclass
class PrefixCache:
    """Everything the suffix needs from one prefix pass.

    layers: per layer, the prefix keys/values (after RoPE).
    pad_mask: (B, P) bool, True on real prefix tokens.
    num_real: (B,) int64, real prefix tokens per sample (the suffix positions start there).
    """

    layers: list[LayerKV]
    pad_mask: Tensor
    num_real: Tensor


class Pi0Policy(PaliGemmaPolicyBase):
    """pi0 flow-matching policy.

    Parameters (names matter for optimizer routing, see the package docstring):
      prefix_embedder.{vision_tower, multi_modal_projector, embed_tokens}: the PaliGemma prefix.
      layers[i].vlm / layers[i].expert: Gemma decoder layer i of each stream (one JointDecoderLayer).
      vlm_norm: the VLM's final norm, kept (frozen) only so checkpoints load: the prefix output is unused.
      expert_norm: the expert's final norm.
      state_proj, action_in_proj, action_time_mlp_in, action_time_mlp_out, action_out_proj: the suffix
        input and output projections.
    """

    def __init__(self, config: Pi0Config) -> None:
        super().__init__()
        if not isinstance(config, Pi0Config):
            raise TypeError(f"Pi0Policy needs a Pi0Config, got {type(config).__name__}")
        self.config = config
        common = {
            "vocab_size": config.vocab_size,
            "rope_theta": config.rope_theta,
            "rms_norm_eps": config.rms_norm_eps,
        }
        vlm_config = gemma_config(config.vlm, **common)
        expert_config = gemma_config(config.expert, **common)
        self.prefix_embedder = PaliGemmaEmbedder(config.vision, config.vlm.width, config.vocab_size)
        depth = config.vlm.depth
        self.layers = nn.ModuleList(
            JointDecoderLayer(vlm_config, expert_config, i, prefix_output_used=i < depth - 1)
            for i in range(depth)
        )
        self.vlm_norm = GemmaRMSNorm(config.vlm.width, eps=config.rms_norm_eps)
        self.vlm_norm.requires_grad_(False)
        self.expert_norm = GemmaRMSNorm(config.expert.width, eps=config.rms_norm_eps)
        # Both streams share positions, and head_dim / RoPE base match, so one table serves both.
        self.rotary_emb = GemmaRotaryEmbedding(vlm_config)

        width = config.expert.width
        self.state_proj = nn.Linear(config.max_state_dim, width)
        self.action_in_proj = nn.Linear(config.max_action_dim, width)
        self.action_time_mlp_in = nn.Linear(2 * width, width)
        self.action_time_mlp_out = nn.Linear(width, width)
        self.action_out_proj = nn.Linear(width, config.max_action_dim)
        if not config.use_state:
            self._hold_state_weight_at_zero()
            # Whatever loads weights (an external checkpoint, a copy of trained ones), the weight stays 0.
            self.register_load_state_dict_post_hook(lambda module, _keys: module._hold_state_weight_at_zero())

        if config.freeze_vision_tower or config.train_expert_only:
            self.prefix_embedder.vision_tower.requires_grad_(False)
        if config.train_expert_only:
            self.prefix_embedder.requires_grad_(False)
            for layer in self.layers:
                layer.vlm.requires_grad_(False)
        self.set_gradient_checkpointing(config.gradient_checkpointing)

    # ----------------------------------------------------------------------------------------- contract
    def compute_loss(
        self, batch: Batch, *, noise: Tensor | None = None, time: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Flow-matching loss: MSE between predicted and true velocity over real dims of non-pad steps.

        Args:
            batch: see vla.types.Batch; actions (B, H, A) normalised and zero-padded.
            noise: (B, H, A) optional fixed noise (default standard normal).
            time: (B,) optional fixed flow times in (0, 1] (default Beta-sampled, see Pi0Config).

        Returns:
            loss (scalar) and metrics {"loss", "action_l1"} (detached scalars). action_l1 is the mean
            |a_hat - a| of the one-step clean-action estimate a_hat = x_t - t * v over the same entries.
        """
        config = self.config
        check_batch(batch, config, text_token_limit=config.vocab_size)
        actions = batch.actions
        b, h, a = actions.shape
        noise = self._noise_or_default(noise, (b, h, a), actions)
        if time is None:
            time = sample_flow_time(
                b,
                alpha=config.time_beta_alpha,
                beta=config.time_beta_beta,
                time_min=config.time_min,
                device=actions.device,
            )
        elif time.shape != (b,):
            raise ValueError(f"time must be (B,) = ({b},), got {tuple(time.shape)}")
        time = time.to(device=actions.device, dtype=torch.float32)

        t = time[:, None, None]
        x_t = t * noise + (1.0 - t) * actions
        target_velocity = noise - actions
        velocity = self._velocity(batch.observation, x_t, time)

        weights = (~batch.action_is_pad.bool())[:, :, None] & batch.action_dim_mask.bool()[:, None, :]
        weights = weights.to(velocity.dtype)
        loss = per_sample_masked_mean((velocity - target_velocity).square(), weights)
        with torch.no_grad():
            action_estimate = x_t - t * velocity
            action_l1 = per_sample_masked_mean((action_estimate - actions).abs(), weights)
        return loss, {"loss": loss.detach(), "action_l1": action_l1}

    @torch.no_grad()
    def sample_actions(
        self, observation: Observation | Batch, *, noise: Tensor | None = None, num_steps: int | None = None
    ) -> Tensor:
        """Actions (B, H, max_action_dim) by Euler integration from noise (t = 1) to t = 0.

        One prefix pass fills a per-layer KV cache; each of the `num_steps` (default
        config.num_inference_steps) steps then runs only the state + action tokens against it.
        All max_action_dim dims are returned; callers keep the dataset's real ones.
        """
        observation = as_observation(observation)
        check_observation(observation, self.config, text_token_limit=self.config.vocab_size)
        b = observation.batch_size
        noise = self._noise_or_default(
            noise, (b, self.config.action_horizon, self.config.max_action_dim), observation.state
        )
        cache = self.fill_prefix_cache(observation)

        def velocity(x_t: Tensor, time: Tensor) -> Tensor:
            return self._velocity_from_cache(cache, observation.state, x_t, time)

        return euler_integrate(velocity, noise, self._num_steps(num_steps))

    # ------------------------------------------------------------------------------------------ helpers
    def _num_steps(self, num_steps: int | None) -> int:
        steps = self.config.num_inference_steps if num_steps is None else num_steps
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
        return steps

    def _noise_or_default(self, noise: Tensor | None, shape: tuple[int, int, int], like: Tensor) -> Tensor:
        if noise is None:
            return torch.randn(shape, device=like.device, dtype=torch.float32)
        if tuple(noise.shape) != shape:
            raise ValueError(f"noise must be (B, H, A) = {shape}, got {tuple(noise.shape)}")
        return noise.to(device=like.device, dtype=torch.float32)

    def _suffix_ar_mask(self, device: torch.device) -> Tensor:
        """(1 + H,) block starts of the suffix: the state opens a block, the action chunk opens the next."""
        ar = torch.zeros(1 + self.config.action_horizon, dtype=torch.bool, device=device)
        ar[:2] = True
        return ar

    def _hold_state_weight_at_zero(self) -> None:
        """For use_state=False: zero and freeze state_proj.weight (at build and after every load)."""
        with torch.no_grad():
            self.state_proj.weight.zero_()
        self.state_proj.weight.requires_grad_(False)

    def embed_suffix(self, state: Tensor, x_t: Tensor, time: Tensor) -> Tensor:
        """State token + action tokens (B, 1 + H, W_expert): action_in_proj(x_t) fused with the time."""
        width = self.config.expert.width
        if not self.config.use_state:
            state = torch.zeros_like(state)
        state_token = self.state_proj(state)[:, None, :]
        action_tokens = self.action_in_proj(x_t)
        time_embedding = sinusoidal_time_embedding(
            time, width, min_period=self.config.time_min_period, max_period=self.config.time_max_period
        )
        time_tokens = time_embedding[:, None, :].expand(-1, x_t.shape[1], -1).to(action_tokens.dtype)
        fused = self.action_time_mlp_in(torch.cat([action_tokens, time_tokens], dim=-1))
        action_tokens = self.action_time_mlp_out(F.silu(fused))
        return torch.cat([state_token.to(action_tokens.dtype), action_tokens], dim=1)

    def _rope(self, positions: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
        return self.rotary_emb(like, positions)

    def sequence_masks(self, prefix_pad: Tensor) -> tuple[Tensor, Tensor]:
        """Pad and block flags (B, P + 1 + H) of the joint sequence: prefix 0, state 1, actions 1, 0, ..."""
        b, device = prefix_pad.shape[0], prefix_pad.device
        suffix_ar = self._suffix_ar_mask(device)
        pad_mask = torch.cat(
            [prefix_pad.bool(), torch.ones(b, suffix_ar.shape[0], dtype=torch.bool, device=device)], 1
        )
        ar_mask = torch.cat([torch.zeros(prefix_pad.shape[1], dtype=torch.bool, device=device), suffix_ar])
        return pad_mask, ar_mask[None].expand(b, -1)

    def _velocity(self, observation: Observation, x_t: Tensor, time: Tensor) -> Tensor:
        """Predicted velocity (B, H, A) float32 from one joint pass over prefix and suffix."""
        prefix, prefix_pad = self.prefix_embedder(observation, self.config.cameras)
        suffix = self.embed_suffix(observation.state, x_t, time)
        pad_mask, ar_mask = self.sequence_masks(prefix_pad)
        attention_mask = make_attention_mask(pad_mask, ar_mask)[:, None]
        cos, sin = self._rope(positions_from_pad_mask(pad_mask), prefix)
        prefix_hidden: Tensor | None = prefix
        suffix_hidden: Tensor | None = suffix
        for layer in self.layers:
            prefix_hidden, suffix_hidden, _ = layer(
                prefix_hidden, suffix_hidden, cos=cos, sin=sin, attention_mask=attention_mask
            )
        assert suffix_hidden is not None
        return self._project_actions(suffix_hidden)

    def _project_actions(self, suffix_hidden: Tensor) -> Tensor:
        action_hidden = self.expert_norm(suffix_hidden[:, 1:])
        return self.action_out_proj(action_hidden).float()

    def fill_prefix_cache(self, observation: Observation) -> PrefixCache:
        """Run the prefix alone through the VLM stream, keeping every layer's keys and values."""
        prefix, prefix_pad = self.prefix_embedder(observation, self.config.cameras)
        no_blocks = torch.zeros(prefix.shape[1], dtype=torch.bool, device=prefix.device)
        attention_mask = make_attention_mask(prefix_pad, no_blocks)[:, None]
        cos, sin = self._rope(positions_from_pad_mask(prefix_pad), prefix)
        hidden: Tensor | None = prefix
        layers_kv: list[LayerKV] = []
        for layer in self.layers:
            hidden, _, kv = layer(
                hidden, None, cos=cos, sin=sin, attention_mask=attention_mask, return_prefix_kv=True
            )
            assert kv is not None
            layers_kv.append(kv)
        return PrefixCache(layers=layers_kv, pad_mask=prefix_pad, num_real=prefix_pad.sum(dim=1))

    def _velocity_from_cache(self, cache: PrefixCache, state: Tensor, x_t: Tensor, time: Tensor) -> Tensor:
        """Predicted velocity (B, H, A) running only the suffix against the cached prefix."""
        suffix = self.embed_suffix(state, x_t, time)
        b, s = suffix.shape[:2]
        suffix_pad = torch.ones(b, s, dtype=torch.bool, device=suffix.device)
        sees_prefix = cache.pad_mask[:, None, :].expand(b, s, -1)
        sees_suffix = make_attention_mask(suffix_pad, self._suffix_ar_mask(suffix.device))
        attention_mask = torch.cat([sees_prefix, sees_suffix], dim=2)[:, None]
        positions = cache.num_real[:, None] + torch.arange(s, device=suffix.device)[None, :]
        cos, sin = self._rope(positions, suffix)
        hidden: Tensor | None = suffix
        for layer, kv in zip(self.layers, cache.layers):
            _, hidden, _ = layer(
                None, hidden, cos=cos, sin=sin, attention_mask=attention_mask, past_prefix=kv
            )
        assert hidden is not None
        return self._project_actions(hidden)

    @torch.no_grad()
    def _sample_actions_uncached(
        self, observation: Observation | Batch, *, noise: Tensor, num_steps: int | None = None
    ) -> Tensor:
        """Slow reference for tests: every Euler step re-runs the full prefix + suffix sequence."""
        observation = as_observation(observation)

        def velocity(x_t: Tensor, time: Tensor) -> Tensor:
            return self._velocity(observation, x_t, time)

        return euler_integrate(velocity, noise.float(), self._num_steps(num_steps))
