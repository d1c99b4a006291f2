"""A Hugging Face cache on disk in the hub's own layout (`<type>s--org--name/{refs/main, snapshots/<hash>}`),
for tests that run offline against it (HF_HUB_CACHE=..., HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo_id: str, repo_type: str, files: dict[str, Path | str | bytes]) -> Path:
    """Put `files` (name -> source path, or text/bytes content) into the cache as repo_id's main revision;
    returns the snapshot directory."""
    org, name = repo_id.split("/")
    repo = cache / f"{repo_type}s--{org}--{name}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    for target, source in files.items():
        path = snapshot / target
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, Path) and source.is_dir():
            shutil.copytree(source, path, dirs_exist_ok=True)
        elif isinstance(source, Path):
            shutil.copyfile(source, path)
        elif isinstance(source, bytes):
            path.write_bytes(source)
        else:
            path.write_text(source)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def paligemma_sized_tokenizer(directory: Path, size: int = 257_152) -> Path:
    """A word-level tokenizer with PaliGemma's number of ids (its real one cannot be downloaded here),
    saved as PaliGemma's repository holds it: tokenizer files and a config.json (AutoTokenizer reads it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for word in [
        "reach",
        "the",
        "goal",
        "push",
        "puck",
        "pick",
        "and",
        "place",
        "open",
        "drawer",
        "press",
        "button",
    ]:
        vocab.setdefault(word, len(vocab))
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), size)})
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(str(directory))
    config = directory / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"TokenizersBackend"', '"PreTrainedTokenizerFast"'))
    (directory / "config.json").write_text('{"model_type": "paligemma"}')
    return directory
