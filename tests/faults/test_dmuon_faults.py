"""dmuon under bad input: mismatched optimizer state, malformed routing rules, NaN hyper-parameters.

Each case ends in a ValueError that names the param group, the param or the rule and the fix, and
leaves the weights untouched; nothing loads or steps silently into a later raw error or NaN weights.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import dmuon
from dmuon import Muon

pytestmark = pytest.mark.timeout(60)


def _model(seed: int = 0, widths: tuple[int, ...] = (12, 40, 24)) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(widths[0], widths[1]), nn.GELU(), nn.Linear(widths[1], widths[2]), nn.LayerNorm(widths[2]),
        nn.Linear(widths[2], 6),
    )  # fmt: skip


def _step(model: nn.Module, opt: Muon, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    x, y = torch.randn(8, model[0].in_features, generator=gen), torch.randn(8, 6, generator=gen)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _trained() -> tuple[nn.Module, Muon, dict]:
    model = _model()
    opt = Muon(dmuon.param_groups(model), lr=0.02, adamw_lr=1e-2)
    _step(model, opt)
    return model, opt, copy.deepcopy(opt.state_dict())


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- load_state_dict -----------------------------------------------------------------------------


def test_state_of_another_param_order_is_refused_naming_the_param() -> None:
    _, opt, state = _trained()
    muon_names = opt.param_groups[0]["param_names"]
    assert muon_names == ["0.weight", "2.weight", "4.weight"]
    twin = _model(1)
    groups = dmuon.param_groups(twin)
    groups[0]["params"].reverse()
    groups[0]["param_names"].reverse()
    twin_opt = Muon(groups, lr=0.02, adamw_lr=1e-2)
    with pytest.raises(
        ValueError,
        match=r"param group 0 \(muon: '4\.weight', '2\.weight', \.\.\.\): param 0 '4\.weight' has shape \(6, 24\), "
        r"but its saved 'momentum_buffer' \(saved as '0\.weight'\) has shape \(40, 12\)\. The optimizer state "
        r"was saved for another model, param order or routing",
    ):
        twin_opt.load_state_dict(state)
    assert len(twin_opt.state) == 0  # nothing was loaded
    before = _weights(twin)
    _step(twin, twin_opt)  # still a working optimizer
    assert all(not torch.equal(a, b) for a, b in zip(before, _weights(twin)))


def test_state_of_another_model_shape_is_refused() -> None:
    _, _, state = _trained()
    other = _model(0, widths=(12, 32, 24))
    other_opt = Muon(dmuon.param_groups(other), lr=0.02, adamw_lr=1e-2)
    with pytest.raises(
        ValueError, match=r"param 0 '0\.weight' has shape \(32, 12\), but its saved 'momentum_buffer'"
    ):
        other_opt.load_state_dict(state)
    # The AdamW side is checked too: exp_avg of the first bias.
    bias_group = next(i for i, g in enumerate(other_opt.param_groups) if g["algorithm"] == "adamw")
    only_adamw = copy.deepcopy(state)
    for index in state["param_groups"][0]["params"]:
        only_adamw["state"].pop(index, None)
    with pytest.raises(
        ValueError,
        match=rf"param group {bias_group} \(adamw: '0\.bias'.*has shape \(32,\), but its saved 'exp_avg'",
    ):
        other_opt.load_state_dict(only_adamw)


def test_group_count_sizes_and_algorithms_must_match() -> None:
    model, _, state = _trained()
    sizes = [len(g["params"]) for g in state["param_groups"]]
    single = Muon([{"params": [p for p in model.parameters() if p.ndim == 2]}], lr=0.02)
    with pytest.raises(
        ValueError, match=rf"has 2 param group\(s\) of \[3, {sizes[1]}\] params, but this Muon has 1 of \[3\]"
    ):
        single.load_state_dict(state)
    flipped = copy.deepcopy(state)
    flipped["param_groups"][0]["algorithm"] = "adamw"
    fresh = Muon(dmuon.param_groups(model), lr=0.02, adamw_lr=1e-2)
    with pytest.raises(
        ValueError,
        match=r"param group 0 \(muon: '0\.weight', .*the saved group 0 is a 'adamw' group, this one is 'muon'",
    ):
        fresh.load_state_dict(flipped)
    with pytest.raises(ValueError, match=r"expects a dict with 'state' and 'param_groups'"):
        single.load_state_dict({"momentum": 1})


def test_saved_non_finite_hyperparameters_are_refused() -> None:
    model, _, state = _trained()
    state["param_groups"][1]["lr"] = math.nan
    fresh = Muon(dmuon.param_groups(model), lr=0.02, adamw_lr=1e-2)
    with pytest.raises(
        ValueError, match=r"saved param group 1 \(adamw: '0\.bias', .*lr must be a finite number, got nan"
    ):
        fresh.load_state_dict(state)
    assert fresh.param_groups[1]["lr"] == 1e-2


def test_renamed_params_of_equal_shape_load_with_a_warning_and_wrapper_prefixes_do_not() -> None:
    model, opt, state = _trained()
    prefixed = dmuon.param_groups(model)
    for group in prefixed:
        group["param_names"] = [f"module._orig_mod.{n}" for n in group["param_names"]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon(prefixed, lr=0.02, adamw_lr=1e-2).load_state_dict(copy.deepcopy(state))
    renamed = dmuon.param_groups(model)
    renamed[1]["param_names"][0] = "encoder.bias"
    loaded = Muon(renamed, lr=0.02, adamw_lr=1e-2)
    with pytest.warns(
        UserWarning,
        match=r"1 param\(s\) have other names.*\(shapes match.*\): group 1 param 0: '0\.bias' -> 'encoder\.bias'\. If the params were reordered",
    ):
        loaded.load_state_dict(copy.deepcopy(state))
    assert loaded.param_groups[1]["lr"] == opt.param_groups[1]["lr"]


# -- routing rules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (
            (r"^0\.", "adamw"),
            r"routing rule 1 is the tuple \('\^0\\\\\.', 'adamw'\); a rule is a dict \{'pattern': regex, \*\*options\}"
            r".*Did you mean \('\^0\\\\\.', \{'algorithm': 'adamw'\}\)\?",
        ),
        ((r"^0\.", "adamw", 0.1), r"routing rule 1 is the tuple .*\(regex, options\) pair"),
        (r"^0\.", r"routing rule 1 is a str \('\^0\\\\\.'\); a rule is a dict"),
        ({"pattern": 3, "lr": 0.1}, r"routing rule 1: the pattern must be a regex string, got int 3"),
        ([r"^0\.", ["adamw"]], r"routing rule 1 is the list .*the options must be a dict"),
    ],
)
def test_malformed_rules_name_the_rule_and_the_forms(rule, message) -> None:
    model = _model()
    with pytest.raises(ValueError, match=message):
        dmuon.param_groups(model, [{"pattern": r"^4\.", "lr": 0.1}, rule])


def test_rules_given_as_one_dict_instead_of_a_list() -> None:
    with pytest.raises(
        ValueError, match=r"routing rules must be a list of rules, got a dict.*wrap it in a list"
    ):
        dmuon.param_groups(_model(), {"pattern": r"^0\.", "algorithm": "adamw"})


@pytest.mark.parametrize("rule", [(r"^0\.", {"algorithm": "adamw"}), [r"^0\.", {"algorithm": "adamw"}]])
def test_pair_rules_route(rule) -> None:
    groups = dmuon.param_groups(_model(), [rule])
    by_name = {n: g["algorithm"] for g in groups for n in g["param_names"]}
    assert by_name["0.weight"] == "adamw" and by_name["2.weight"] == "muon"


# -- hyper-parameters changed after construction ------------------------------------------------


@pytest.mark.parametrize(
    ("group_index", "key", "value", "message"),
    [
        (
            0,
            "lr",
            math.nan,
            r"param group 0 \(muon: '0\.weight', '2\.weight', \.\.\.\): lr must be a finite number, got nan",
        ),
        (0, "lr", math.inf, r"param group 0 .*lr must be a finite number, got inf"),
        (0, "weight_decay", math.nan, r"param group 0 .*weight_decay must be a finite number, got nan"),
        (0, "momentum", math.nan, r"param group 0 .*momentum must be a finite number, got nan"),
        (0, "lr", -0.1, r"param group 0 .*lr must be in \[0\.0, inf\], got -0\.1"),
        (1, "lr", math.inf, r"param group 1 \(adamw: '0\.bias', .*lr must be a finite number, got inf"),
        (1, "betas", (0.9, math.nan), r"param group 1 .*betas\[1\] must be a finite number, got nan"),
        (1, "eps", 0.0, r"param group 1 .*eps must be > 0, got 0\.0"),
    ],
)
def test_non_finite_hyperparameters_set_after_construction_fail_before_any_update(
    group_index, key, value, message
) -> None:
    model = _model()
    opt = Muon(dmuon.param_groups(model), lr=0.02, adamw_lr=1e-2)
    _step(model, opt)
    opt.param_groups[group_index][key] = value
    before = _weights(model)
    with pytest.raises(ValueError, match=message + r".*changed after construction"):
        _step(model, opt, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_scheduler_that_yields_nan_is_caught_at_the_step() -> None:
    model = _model()
    opt = Muon(dmuon.param_groups(model), lr=0.02, adamw_lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step < 2 else math.nan)
    for step in range(2):
        _step(model, opt, seed=step)
        scheduler.step()
    before = _weights(model)
    with pytest.raises(
        ValueError, match=r"param group 0 .*lr must be a finite number, got nan.*an LR scheduler"
    ):
        _step(model, opt, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
