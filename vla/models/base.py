"""What pi0 and the OpenVLA-style policy share: a PaliGemma prefix and a stack of decoder layers."""

from __future__ import annotations

from torch import Tensor, nn

from vla.models.paligemma import set_layer_checkpointing
from vla.types import Batch


class PaliGemmaPolicyBase(nn.Module):
    """Subclasses set `self.prefix_embedder` (PaliGemmaEmbedder) and `self.layers` and define
    `compute_loss`; this class provides the rest of the trainer-facing contract."""

    prefix_embedder: nn.Module
    layers: nn.ModuleList

    def shard_units(self) -> list[nn.Module]:
        """FSDP2 wraps each decoder layer (pi0: each layer pair) and each vision encoder layer."""
        return [*self.layers, *self.prefix_embedder.vision_layers()]

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        set_layer_checkpointing(self.shard_units(), enabled)

    def forward(
        self, batch: Batch, *, noise: Tensor | None = None, time: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The training objective, as `compute_loss`: DDP and FSDP2 hook `__call__`, so wrapped
        policies are trained through `model(batch)`."""
        return self.compute_loss(batch, noise=noise, time=time)

    def compute_loss(
        self, batch: Batch, *, noise: Tensor | None = None, time: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError
