"""The built-in tokenizer (offline, deterministic, < 640 ids) and a local-path tokenizer share one interface."""

from __future__ import annotations

import pytest
import torch

from vla.data import PromptTokenizer, load_tokenizer
from vla.data import tokenizer as tokenizer_module


def test_builtin_tokenizer_is_small_and_has_the_special_tokens() -> None:
    tokenizer = load_tokenizer(None)
    assert len(tokenizer) == tokenizer.vocab_size == tokenizer_module.BUILTIN_VOCAB_SIZE
    assert len(tokenizer) < 640 - 0  # the tiny model presets reserve ids >= 640 for action tokens
    assert len(tokenizer) < 400
    assert (
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        tokenizer.bos_token_id,
        tokenizer.unk_token_id,
    ) == (0, 1, 2, 3)


def test_builtin_tokenizer_is_deterministic() -> None:
    first = load_tokenizer(None).encode("Reach the red target\n", add_special_tokens=False)
    tokenizer_module._builtin_tokenizer_json.cache_clear()
    second = load_tokenizer(None).encode("Reach the red target\n", add_special_tokens=False)
    assert first == second
    assert len(first) <= 6  # learnt merges: common instruction words are single tokens


def test_round_trip_covers_any_text_lower_cased() -> None:
    tokenizer = load_tokenizer(None)
    text = "Put the Crème-Brûlée on shelf #3 → left\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert max(ids) < len(tokenizer)
    assert tokenizer.decode(ids) == text.lower()
    assert tokenizer("pick")["input_ids"][0] == tokenizer.bos_token_id  # like Gemma: BOS by default


def test_prompt_format_padding_and_truncation() -> None:
    tokenizer = load_tokenizer(None)
    prompts = PromptTokenizer(tokenizer, max_length=12)
    ids, mask = prompts(["reach the red_target", "a" * 50])
    assert ids.shape == mask.shape == (2, 12) and ids.dtype == torch.int64 and mask.dtype == torch.bool
    length = int(mask[0].sum())
    assert ids[0, 0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[0, 1:length].tolist()) == "reach the red target\n"
    assert torch.all(ids[0, length:] == tokenizer.pad_token_id) and not mask[0, length:].any()
    assert mask[1].all()  # truncated to max_length


def test_local_path_tokenizer_has_the_same_interface(tmp_path) -> None:
    load_tokenizer(None).save_pretrained(tmp_path / "tok")
    local = load_tokenizer(tmp_path / "tok")
    builtin = PromptTokenizer(load_tokenizer(None), 16)
    loaded = PromptTokenizer(local, 16)
    assert torch.equal(builtin(["open the drawer"])[0], loaded(["open the drawer"])[0])
    assert loaded.vocab_size == builtin.vocab_size
    with pytest.raises(FileNotFoundError, match=r"does not exist.*built-in tokenizer"):
        load_tokenizer(tmp_path / "missing")
