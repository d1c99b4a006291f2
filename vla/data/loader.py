"""DataLoader for training: deterministic per-rank sharding, resumable mid-epoch, uint8 transport.

    loader = make_dataloader(dataset, processor, batch_size=32, num_workers=2, seed=0,
                             rank=rank, world_size=world, device="cuda")
    loader.load_state_dict(saved)          # resume: same epoch, skips the batches already seen
    for batch in loader.forever(): ...     # Batch on `device`, images float32 in [-1, 1]
    saved = loader.state_dict()

The order of epoch e is a permutation seeded by (seed, e); rank r takes every world_size-th index of
it, so ranks see disjoint samples and a resumed run replays exactly the remaining batches.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from vla.data.augment import AUGMENT_KEY, ImageAugmenter
from vla.data.errors import DatasetTooSmallError
from vla.data.mixture import TaskMixture
from vla.data.processor import BatchProcessor
from vla.types import Batch


class ShardedResumableSampler(Sampler[int]):
    """Indices of one rank for one epoch; `start` skips the first positions (for resuming).

    Without drop_last the permutation is padded by wrapping around so every rank gets the same count
    (as torch's DistributedSampler); with drop_last the tail that does not divide is dropped. With a
    `mixture` (per-task weights, vla.data.mixture) a shuffled epoch is the mixture's draws instead of a
    permutation, as many as there are samples.
    """

    def __init__(
        self,
        num_samples: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        mixture: TaskMixture | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if num_samples < world_size:
            raise DatasetTooSmallError(
                f"{num_samples} samples cannot be sharded over {world_size} ranks: every rank needs at least "
                "one frame. Add episodes, lower data.val_fraction or run on fewer processes."
            )
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        if mixture is not None and mixture.num_samples != num_samples:
            raise ValueError(f"the mixture draws {mixture.num_samples} samples an epoch, not {num_samples}")
        self.mixture = mixture
        self.epoch = 0
        self.start = 0

    @property
    def samples_per_rank(self) -> int:
        if self.drop_last:
            return self.num_samples // self.world_size
        return -(-self.num_samples // self.world_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_start(self, start: int) -> None:
        if not 0 <= start <= self.samples_per_rank:
            raise ValueError(f"start {start} outside [0, {self.samples_per_rank}]")
        self.start = start

    def indices(self) -> list[int]:
        """This rank's full index list for the current epoch (ignores `start`)."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            if self.mixture is not None:
                order = self.mixture.order(generator)
            else:
                order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        total = self.samples_per_rank * self.world_size
        if total > len(order):
            order = (order * (total // len(order) + 1))[:total]
        return order[:total][self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.start :])

    def __len__(self) -> int:
        return self.samples_per_rank - self.start


class _EpochKeyedSampler(Sampler[tuple[int, int]]):
    """The sampler's indices as (epoch, index) pairs: what augmentation seeds each frame's draw with."""

    def __init__(self, sampler: ShardedResumableSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.sampler.epoch
        return ((epoch, index) for index in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class _EpochKeyedDataset(Dataset):
    """dataset[(epoch, index)] = dataset[index] plus its AUGMENT_KEY (epoch, index)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        item = self.dataset[key[1]]
        item[AUGMENT_KEY] = key
        return item


def worker_context() -> multiprocessing.context.BaseContext:
    """How loader workers start: from a forkserver, a clean single-threaded process.

    Forking the training process itself (DataLoader's default) copies a process with threads (gloo's,
    tensorboard's writer, watchdogs): a worker can inherit a lock that another thread held at the fork.
    On CPython 3.11.7 that was seen here: both workers of a validation loader stopped for good inside
    the fork (PyOS_AfterFork_Child waiting on the runtime's HEAD_LOCK, gh-112275, fixed in 3.11.8),
    before any of our code ran, and the DataLoader waits on its workers without a bound. The server
    imports this module (torch and vla.data) once, so a worker starts as fast as a fork.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def _worker_init(worker_id: int) -> None:
    # Each worker decodes on its own core: torch's intra-op threads would only oversubscribe.
    torch.set_num_threads(1)


class BatchLoader:
    """Iterable of Batches over one rank's shard; tracks (epoch, batches_in_epoch) for resuming."""

    def __init__(
        self,
        dataset: Dataset,
        processor: BatchProcessor,
        batch_size: int,
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int = 0,
        drop_last: bool = True,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str | None = None,
        pin_memory: bool = False,
        prefetch_factor: int | None = 2,
        persistent_workers: bool = True,
        augment: ImageAugmenter | None = None,
        mixture: TaskMixture | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        self.dataset = dataset
        self.processor = processor
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else None
        self.sampler = ShardedResumableSampler(
            len(dataset), shuffle, seed, rank, world_size, drop_last, mixture
        )
        per_rank = self.sampler.samples_per_rank
        if drop_last and per_rank < batch_size:
            # Without this check `forever()` would spin on empty epochs: a hang at 100% CPU.
            raise DatasetTooSmallError(
                f"the training split has {len(dataset)} frames, {per_rank} per rank over {world_size} "
                f"rank(s), fewer than one batch of {batch_size} frames per rank; with drop_last=True the "
                "partial batch is dropped, so an epoch would hold no batch at all. Lower trainer.batch_size "
                "(the global batch is the per-rank batch x ranks x grad_accum), add episodes to the dataset "
                "or lower data.val_fraction so more episodes stay in training."
            )
        self.epoch = 0
        self.batches_in_epoch = 0
        self.augment = augment
        collate = functools.partial(processor.collate, augment=augment) if augment else processor.collate
        self.loader = DataLoader(
            _EpochKeyedDataset(dataset) if augment is not None else dataset,
            batch_size=batch_size,
            sampler=_EpochKeyedSampler(self.sampler) if augment is not None else self.sampler,
            # Augmentation runs here, in the workers, on uint8 images; its draws depend on (epoch, index)
            # alone, so a resumed or re-sharded run augments every frame as the uninterrupted run did.
            collate_fn=collate,
            num_workers=num_workers,
            drop_last=drop_last,
            pin_memory=pin_memory,
            worker_init_fn=_worker_init if num_workers > 0 else None,
            multiprocessing_context=worker_context() if num_workers > 0 else None,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            persistent_workers=persistent_workers and num_workers > 0,
        )

    def __len__(self) -> int:
        """Batches in a full epoch of this rank."""
        per_rank = self.sampler.samples_per_rank
        return per_rank // self.batch_size if self.loader.drop_last else -(-per_rank // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the current epoch; the epoch counter advances when it is exhausted."""
        self.sampler.set_epoch(self.epoch)
        self.sampler.set_start(min(self.batches_in_epoch * self.batch_size, self.sampler.samples_per_rank))
        non_blocking = self.loader.pin_memory
        for batch in self.loader:
            if self.device is not None:
                batch = batch.to(self.device, non_blocking=non_blocking)
            self.batches_in_epoch += 1
            yield self.processor.finalize(batch)
        self.epoch += 1
        self.batches_in_epoch = 0

    def forever(self) -> Iterator[Batch]:
        """Epoch after epoch, resuming where the state says.

        Raises DatasetTooSmallError instead of looping when a whole epoch yields no batch (a
        dataset that shrank under the loader); the constructor already rejects the usual case.
        """
        while True:
            started_at = self.batches_in_epoch
            yielded = False
            for batch in self:
                yielded = True
                yield batch
            # A resumed epoch that was already complete may legitimately yield nothing; a full one may not.
            if not yielded and started_at == 0:
                raise DatasetTooSmallError(
                    f"a full epoch over {len(self.dataset)} frames yielded no batch of {self.batch_size} "
                    f"frames on rank {self.sampler.rank} of {self.sampler.world_size}. Lower "
                    "trainer.batch_size, add episodes or lower data.val_fraction."
                )

    def state_dict(self) -> dict[str, Any]:
        sampler = self.sampler
        return {
            "epoch": self.epoch,
            "batches_in_epoch": self.batches_in_epoch,
            "batch_size": self.batch_size,
            "seed": sampler.seed,
            "world_size": sampler.world_size,
            "num_samples": sampler.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; the batch size, seed, world size and dataset size must match the saved run."""
        mine = self.state_dict()
        changed = [k for k in ("batch_size", "seed", "world_size", "num_samples") if state.get(k) != mine[k]]
        if changed:
            raise ValueError(
                f"loader state was saved with {[(k, state.get(k)) for k in changed]} but this loader has "
                f"{[(k, mine[k]) for k in changed]}; the sample order would differ. Resume with the same "
                "settings or start a fresh epoch."
            )
        self.epoch = int(state["epoch"])
        self.batches_in_epoch = int(state["batches_in_epoch"])


def make_dataloader(
    dataset: Dataset,
    processor: BatchProcessor,
    batch_size: int,
    shuffle: bool = True,
    num_workers: int = 0,
    seed: int = 0,
    drop_last: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    device: torch.device | str | None = None,
    **loader_kwargs: Any,
) -> BatchLoader:
    """A BatchLoader; rank/world_size default to torch.distributed's (or RANK/WORLD_SIZE, else 0/1)."""
    if rank is None or world_size is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return BatchLoader(
        dataset,
        processor,
        batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        seed=seed,
        drop_last=drop_last,
        rank=rank,
        world_size=world_size,
        device=device,
        **loader_kwargs,
    )
