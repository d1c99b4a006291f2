"""dmuon.param_groups: default routing, ordered rules, coverage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon import describe_param_groups, param_groups


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 16, tie: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "attn": nn.Linear(width, 3 * width),
                    "mlp": nn.Linear(width, 4 * width, bias=False),
                    "down": nn.Linear(4 * width, width),
                    "ln": nn.LayerNorm(width),
                }
            )
            for _ in range(2)
        )
        self.conv = nn.Conv2d(3, 8, 3)
        self.scale = nn.Parameter(torch.ones(()))
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.final_rms = nn.RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed_tokens.weight


def _routing(groups) -> dict[str, str]:
    return {name: g["algorithm"] for g in groups for name in g["param_names"]}


@pytest.mark.parametrize("tie", [False, True])
def test_default_routing(tie) -> None:
    model = TinyLM(tie=tie)
    routing = _routing(param_groups(model))
    assert routing["embed_tokens.weight"] == "adamw"
    assert routing["blocks.0.attn.weight"] == "muon" and routing["blocks.1.down.weight"] == "muon"
    assert routing["blocks.0.mlp.weight"] == "muon"
    assert routing["conv.weight"] == "muon"  # 4-D: orthogonalised as (8, 27)
    for name in ("blocks.0.attn.bias", "blocks.0.ln.weight", "blocks.0.ln.bias", "scale", "final_rms.weight"):
        assert routing[name] == "adamw", name
    if tie:
        assert "lm_head.weight" not in routing  # one tensor, listed once under its first name
    else:
        assert routing["lm_head.weight"] == "adamw"


def test_every_trainable_parameter_lands_in_exactly_one_group() -> None:
    model = TinyLM()
    groups = param_groups(model, rules=[{"pattern": r"blocks\.1\.", "lr": 0.01}])
    seen = [id(p) for g in groups for p in g["params"]]
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert sorted(seen) == sorted(trainable) and len(seen) == len(set(seen))
    assert all(len(g["params"]) == len(g["param_names"]) for g in groups)
    assert "frozen.weight" not in _routing(groups)


def test_linear_projecting_onto_the_vocabulary_is_adamw_even_with_another_name() -> None:
    model = TinyLM()
    model.decoder = nn.Linear(16, 50)  # out_features == vocab, wider than its input
    assert _routing(param_groups(model))["decoder.weight"] == "adamw"


def test_a_hidden_layer_as_wide_as_the_vocabulary_stays_in_muon() -> None:
    model = TinyLM(vocab=64)  # blocks.*.mlp is 16 -> 64: as wide as the vocabulary, but a hidden layer
    routing = _routing(param_groups(model))
    assert routing["blocks.0.mlp.weight"] == "muon" and routing["lm_head.weight"] == "adamw"


def test_rules_are_ordered_first_match_wins_and_carry_options() -> None:
    model = TinyLM()
    groups = param_groups(
        model,
        rules=[
            {"pattern": r"blocks\.0\.attn\.weight", "algorithm": "adamw", "lr": 1e-3},
            ("blocks\\.0\\.", {"lr": 0.005}),  # attn.weight already matched above
            {"pattern": r"lm_head", "algorithm": "muon"},
        ],
        muon_options={"weight_decay": 0.1},
    )
    by_name = {name: g for g in groups for name in g["param_names"]}
    assert (
        by_name["blocks.0.attn.weight"]["algorithm"] == "adamw"
        and by_name["blocks.0.attn.weight"]["lr"] == 1e-3
    )
    assert (
        by_name["blocks.0.mlp.weight"]["lr"] == 0.005
        and by_name["blocks.0.mlp.weight"]["algorithm"] == "muon"
    )
    assert (
        by_name["blocks.0.ln.weight"]["algorithm"] == "adamw" and by_name["blocks.0.ln.weight"]["lr"] == 0.005
    )
    assert by_name["lm_head.weight"]["algorithm"] == "muon"
    assert (
        by_name["blocks.1.mlp.weight"]["weight_decay"] == 0.1 and "lr" not in by_name["blocks.1.mlp.weight"]
    )


def test_rule_errors() -> None:
    model = TinyLM()
    with pytest.raises(ValueError, match=r"matched no trainable parameter: \['vision_tower'\]"):
        param_groups(model, rules=[{"pattern": "vision_tower", "lr": 0.1}])
    with pytest.raises(ValueError, match="frozen"):  # frozen params are not matchable either
        param_groups(model, rules=[{"pattern": "^frozen", "lr": 0.1}])
    with pytest.raises(ValueError, match="needs ndim >= 2"):
        param_groups(model, rules=[{"pattern": r"ln\.bias", "algorithm": "muon"}])
    with pytest.raises(ValueError, match="invalid regex"):
        param_groups(model, rules=[{"pattern": "blocks[", "lr": 0.1}])
    with pytest.raises(ValueError, match="no 'pattern'"):
        param_groups(model, rules=[{"lr": 0.1}])
    with pytest.raises(ValueError, match="'muon' or 'adamw'"):
        param_groups(model, rules=[{"pattern": "conv", "algorithm": "lion"}])


def test_describe_reports_counts() -> None:
    text = describe_param_groups(param_groups(TinyLM()))
    assert "muon 7 tensors" in text and "adamw" in text and "total:" in text
