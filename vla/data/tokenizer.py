"""Prompt tokenisation, offline.

`load_tokenizer(path)` returns a Hugging Face fast tokenizer:
- with a local directory: `AutoTokenizer.from_pretrained(path, local_files_only=True)`, e.g. PaliGemma's;
- with a hub id (`google/paligemma-3b-pt-224`): through transformers and the Hugging Face cache
  (HF_HOME / HF_HUB_CACHE); HF_HUB_OFFLINE=1 uses the cache only. Not cached and not reachable:
  TokenizerUnavailableError says how to get it;
- with None or "builtin": a small byte-level BPE built here deterministically (256 byte tokens, 4 specials,
  BPE merges learnt from a fixed corpus of robot instructions; BUILTIN_VOCAB_SIZE ids in all,
  lower-cased). The tiny/small model presets have vocab 1024 and reserve the top 384 ids for
  OpenVLA action tokens, so the built-in vocabulary must stay below 640.

`PromptTokenizer` formats prompts like openpi/PaliGemma: BOS + cleaned task text + "\n", then
truncates/right-pads to a fixed length with a mask.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vla.data.errors import DatasetError

logger = logging.getLogger(__name__)

BUILTIN = "builtin"
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"  # LeRobot's pi0 and openpi tokenize with it
PALIGEMMA_TOKENIZER_SIZE = 257_152
BUILTIN_VOCAB_SIZE = 384
MAX_BUILTIN_VOCAB_SIZE = 640
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0, 1, 2, 3

_OBJECTS = (
    "target", "cube", "block", "bowl", "plate", "cup", "mug", "drawer", "door", "box", "basket",
    "bottle", "sponge", "towel", "lid", "pot", "pan", "stove", "shelf", "table", "cabinet", "microwave",
    "ball", "can", "object", "button", "handle", "tray",
)  # fmt: skip
_COLOURS = ("red", "green", "blue", "yellow", "white", "black", "orange", "purple", "pink", "brown")
_VERBS = (
    "move to", "reach", "pick up", "put", "place", "push", "pull", "open", "close", "turn on",
    "turn off", "stack", "lift", "grasp", "slide", "insert", "rotate", "wipe", "pour", "fold",
)  # fmt: skip
_PLACES = ("on the table", "in the bowl", "into the drawer", "on top of the box", "to the left",
           "to the right", "next to the plate", "in the basket", "on the shelf")  # fmt: skip


def _training_corpus() -> list[str]:
    """Fixed instruction-like sentences plus the word list, so every listed word gets merges."""
    words = [*_COLOURS, *_OBJECTS, *(w for phrase in _VERBS + _PLACES for w in phrase.split())]
    words += ["target", "and", "it", "of", "up", "both", "from", "with", "then"]
    sentences = [
        f"{verb} the {colour} {obj} {place}"
        for verb in _VERBS
        for colour in _COLOURS
        for obj in _OBJECTS[:6]
        for place in _PLACES[:3]
    ]
    return [" ".join(dict.fromkeys(words))] * 5 + sentences


@functools.lru_cache(maxsize=1)
def _builtin_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BUILTIN_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(), trainer)
    bos_id = tokenizer.token_to_id("<bos>")
    # Like Gemma's tokenizer: encode(text) prepends BOS unless add_special_tokens=False.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", bos_id)]
    )
    return tokenizer.to_str()


def build_builtin_tokenizer() -> Any:
    """The project's small tokenizer as a `transformers.PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_builtin_tokenizer_json()),
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    if len(tokenizer) >= MAX_BUILTIN_VOCAB_SIZE:
        raise AssertionError(
            f"built-in tokenizer has {len(tokenizer)} ids; must be < {MAX_BUILTIN_VOCAB_SIZE}"
        )
    return tokenizer


def save_word_level_tokenizer(directory: Path, words: Sequence[str], size: int = PALIGEMMA_TOKENIZER_SIZE) -> Path:
    """Save a word-level tokenizer of `size` ids to `directory` as a PaliGemma checkpoint holds one
    (tokenizer files and a config.json that AutoTokenizer reads), for offline checks where PaliGemma's
    own tokenizer cannot be downloaded: ids 0-3 are SPECIAL_TOKENS, then `words` (lower-case, split on
    whitespace), then `<unusedN>` fillers. Like Gemma's, encode(text) prepends BOS unless
    add_special_tokens=False, so LeRobot's tokenizer step and PromptTokenizer give the same ids."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for word in words:
        vocab.setdefault(word.lower(), len(vocab))
    if len(vocab) > size:
        raise ValueError(f"{len(vocab)} words and special tokens do not fit in {size} ids")
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), size)})
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.normalizer = normalizers.Lowercase()
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    directory = save_portable(tokenizer, directory)
    (directory / "config.json").write_text('{"model_type": "paligemma"}')
    return directory


def save_portable(tokenizer: Any, directory: Path) -> Path:
    """`tokenizer.save_pretrained(directory)` that transformers 4.x loads too (LeRobot 0.4 runs on it):
    transformers 5 records its fast tokenizers' class as "TokenizersBackend", which 4.x does not know;
    the same files under 4.x's name for it, PreTrainedTokenizerFast, load in both."""
    directory = Path(directory)
    tokenizer.save_pretrained(str(directory))
    config = directory / "tokenizer_config.json"
    if config.is_file():
        settings = json.loads(config.read_text())
        if settings.get("tokenizer_class") == "TokenizersBackend":
            settings["tokenizer_class"] = "PreTrainedTokenizerFast"
            config.write_text(json.dumps(settings, indent=2))
    return directory


class TokenizerUnavailableError(DatasetError, FileNotFoundError):
    """The configured tokenizer is neither a local directory nor in the Hugging Face cache."""


def is_builtin(path: str | Path | None) -> bool:
    return path is None or str(path) in ("", BUILTIN)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | Path | None = None) -> Any:
    """A tokenizer from a local directory, a hub id (through the cache) or, with None/"builtin", the
    built-in one. Cached per path: the pre-flight check and the data pipeline share one load."""
    if is_builtin(path):
        return build_builtin_tokenizer()
    from transformers import AutoTokenizer

    from vla.data.hub import cache_dir, looks_like_hub_id, offline_reason

    text = str(path)
    if looks_like_hub_id(text):
        try:
            return AutoTokenizer.from_pretrained(text, local_files_only=True)
        except OSError:
            pass  # not cached
        reason = offline_reason()
        if reason is None:
            return AutoTokenizer.from_pretrained(text)
        raise TokenizerUnavailableError(
            f"tokenizer {text!r} (data.tokenizer_path) is not in the Hugging Face cache ({cache_dir()}) "
            f"and {reason}. On a machine with access run "
            f"`hf download {text} --include 'tokenizer*' 'special_tokens_map.json'` (then copy "
            "the cache, HF_HUB_CACHE, over), or set data.tokenizer_path=<local directory with "
            "tokenizer.json>; data.tokenizer_path=builtin uses the project's small tokenizer (its ids do "
            "not match PaliGemma's pretrained embeddings)."
        ) from None
    local = Path(text).expanduser()
    if not local.exists():
        raise TokenizerUnavailableError(
            f"tokenizer path {local} (data.tokenizer_path) does not exist. Point it at a local directory with "
            "tokenizer.json / tokenizer.model (e.g. a PaliGemma checkpoint folder), a hub id such as "
            f"{PALIGEMMA_TOKENIZER}, or `builtin` for the built-in tokenizer."
        )
    return AutoTokenizer.from_pretrained(str(local), local_files_only=True)


def tokenizer_reference(path: str | Path | None, tokenizer: Any, save_dir: Path) -> str:
    """What `AutoTokenizer.from_pretrained` needs to load this run's tokenizer elsewhere (LeRobot's
    processor): the hub id, the local directory (absolute), or for the built-in tokenizer the absolute
    path of a copy saved to `save_dir`."""
    if is_builtin(path):
        save_portable(tokenizer, save_dir)
        return str(save_dir.resolve())
    from vla.data.hub import looks_like_hub_id

    text = str(path)
    return text if looks_like_hub_id(text) else str(Path(text).expanduser().resolve())


def clean_prompt(text: str) -> str:
    """openpi's cleaning: strip, underscores and newlines to spaces."""
    return text.strip().replace("_", " ").replace("\n", " ")


class PromptTokenizer:
    """Task strings -> (ids (B, max_length) int64 right-padded, mask (B, max_length) bool).

    Each prompt is BOS + clean_prompt(task) + "\\n", truncated to max_length (the tail is dropped,
    with a warning the first time).
    """

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        if max_length < 2:
            raise ValueError(f"max prompt length must be >= 2, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.bos_id = tokenizer.bos_token_id
        self._warned_truncation = False
        self._ids: dict[str, list[int]] = {}  # a dataset has few distinct tasks: encode each once

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, prompt: str) -> list[int]:
        ids = self._ids.get(prompt)
        if ids is None:
            text_ids = self.tokenizer.encode(clean_prompt(prompt) + "\n", add_special_tokens=False)
            ids = ([self.bos_id] if self.bos_id is not None else []) + list(text_ids)
            if len(self._ids) < 100_000:
                self._ids[prompt] = ids
        return ids

    def __call__(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        ids = torch.full((len(prompts), self.max_length), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(prompts), self.max_length), dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            tokens = self.encode(prompt)
            if len(tokens) > self.max_length and not self._warned_truncation:
                logger.warning(
                    "prompt %r has %d tokens; truncated to max prompt length %d",
                    prompt,
                    len(tokens),
                    self.max_length,
                )
                self._warned_truncation = True
            tokens = tokens[: self.max_length]
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            mask[row, : len(tokens)] = True
        return ids, mask
