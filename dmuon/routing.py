"""Route a model's parameters to Muon or AdamW groups, by name and shape.

Muon suits hidden weight matrices. Embeddings (a lookup, not a linear map), output heads that
project to the vocabulary, norms, biases and scalars belong to AdamW. Routing has to look at names
and modules, not only shapes: an embedding is 2-D but must not get Muon.

Order of decisions for each trainable parameter (first that applies wins):
  1. the user's ordered regex rules (`re.search` on the full parameter name);
  2. ndim < 2 -> AdamW;
  3. the weight of an nn.Embedding, of a norm module, or of a Linear tied to an embedding or
     projecting onto its vocabulary from outside the repeated blocks -> AdamW;
  4. a name matching DEFAULT_ADAMW_PATTERNS -> AdamW;
  5. otherwise -> Muon.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

DEFAULT_ADAMW_PATTERNS: tuple[str, ...] = (
    r"(^|\.)(embed\w*|wte|wpe|tok_embeddings)(\.|$)",
    r"(^|\.)(lm_head|head|classifier|output_layer)(\.|$)",
    r"(^|\.)\w*norm\w*(\.|$)",
)

Rule = Mapping[str, Any] | tuple[str, Mapping[str, Any]]
OPTIMIZER_CHOICES = ("muon", "adamw")


_RULE_FORMS = (
    "a dict {'pattern': regex, **options}, e.g. {'pattern': r'vision_tower\\.', 'algorithm': 'adamw'}, or a "
    "(regex, options) pair, e.g. (r'vision_tower\\.', {'algorithm': 'adamw', 'lr': 0.005})"
)


def _rule_parts(i: int, rule: Any) -> tuple[Any, dict[str, Any]]:
    """(pattern, options) of rule i; ValueError naming the rule and the accepted forms otherwise."""
    if isinstance(rule, Mapping):
        options = dict(rule)
        if "pattern" not in options:
            raise ValueError(
                f"routing rule {i} has no 'pattern' key: {dict(rule)!r}. A rule is {_RULE_FORMS}."
            )
        return options.pop("pattern"), options
    if isinstance(rule, Sequence) and not isinstance(rule, (str, bytes)):
        if len(rule) == 2 and isinstance(rule[1], Mapping):
            return rule[0], dict(rule[1])
        hint = ""
        if len(rule) == 2 and rule[1] in OPTIMIZER_CHOICES:
            hint = f" Did you mean ({rule[0]!r}, {{'algorithm': {rule[1]!r}}})?"
        raise ValueError(
            f"routing rule {i} is the {type(rule).__name__} {rule!r}; a rule is {_RULE_FORMS} (the "
            f"options must be a dict).{hint}"
        )
    raise ValueError(f"routing rule {i} is a {type(rule).__name__} ({rule!r}); a rule is {_RULE_FORMS}.")


def _normalise_rules(rules: Sequence[Rule] | None) -> list[tuple[re.Pattern[str], dict[str, Any]]]:
    if isinstance(rules, (str, Mapping)):
        raise ValueError(
            f"routing rules must be a list of rules, got a {type(rules).__name__} ({rules!r}); "
            f"wrap it in a list: [rule], where a rule is {_RULE_FORMS}."
        )
    parsed: list[tuple[re.Pattern[str], dict[str, Any]]] = []
    for i, rule in enumerate(rules or ()):
        pattern, options = _rule_parts(i, rule)
        if not isinstance(pattern, str):
            raise ValueError(
                f"routing rule {i}: the pattern must be a regex string, got {type(pattern).__name__} "
                f"{pattern!r}. A rule is {_RULE_FORMS}."
            )
        if "algorithm" in options and options["algorithm"] not in OPTIMIZER_CHOICES:
            raise ValueError(
                f"routing rule {i} ({pattern!r}): algorithm must be 'muon' or 'adamw', got "
                f"{options['algorithm']!r}"
            )
        try:
            parsed.append((re.compile(pattern), options))
        except re.error as exc:
            raise ValueError(f"routing rule {i}: invalid regex {pattern!r}: {exc}") from exc
    return parsed


def _module_adamw_params(model: nn.Module) -> dict[int, str]:
    """id(param) -> reason, for params whose module type says AdamW."""
    reasons: dict[int, str] = {}
    vocab_sizes: set[int] = set()
    embedding_weights: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            reasons[id(module.weight)] = "embedding"
            vocab_sizes.add(module.num_embeddings)
            embedding_weights.add(id(module.weight))
        elif "norm" in type(module).__name__.lower():
            for p in module.parameters(recurse=False):
                reasons[id(p)] = "norm"
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if id(module.weight) in embedding_weights:
                reasons[id(module.weight)] = "tied to an embedding"
            elif (
                module.out_features in vocab_sizes
                and module.out_features > module.in_features
                # Heads sit outside the repeated blocks; inside them (layers.3.mlp...) a width that
                # happens to equal the vocabulary size is a hidden layer.
                and not any(part.isdigit() for part in name.split("."))
            ):
                reasons[id(module.weight)] = "projects onto a vocabulary"
    return reasons


def param_groups(
    model: nn.Module,
    rules: Sequence[Rule] | None = None,
    *,
    muon_options: Mapping[str, Any] | None = None,
    adamw_options: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Param groups for `dmuon.Muon`: every trainable parameter lands in exactly one group.

    rules: ordered overrides, first match wins; each is `{"pattern": regex, **group_options}` or
        `(regex, group_options)`, where options may set "algorithm" and any group hyper-parameter
        (e.g. `{"pattern": r"vision_tower\\.", "lr": 0.005}`). A rule without "algorithm" keeps the
        default routing and only adds its options. A rule that matches no trainable parameter is
        an error (it is almost always a typo).
    muon_options / adamw_options: extra keys for every Muon / AdamW group.

    Returns groups with "params", "param_names" (same order) and "algorithm"; parameters with equal
    options share one group. Tied parameters appear once, under their first name.
    """
    parsed = _normalise_rules(rules)
    module_reasons = _module_adamw_params(model)
    default_patterns = [re.compile(p) for p in DEFAULT_ADAMW_PATTERNS]
    rule_hits = [0] * len(parsed)
    groups: dict[tuple, dict[str, Any]] = {}
    for name, p in model.named_parameters():  # named_parameters() skips tied duplicates
        if not p.requires_grad:
            continue
        options: dict[str, Any] = {}
        algorithm = None
        for i, (regex, rule_options) in enumerate(parsed):
            if regex.search(name):
                rule_hits[i] += 1
                options = {k: v for k, v in rule_options.items() if k != "algorithm"}
                algorithm = rule_options.get("algorithm")
                break
        if algorithm is None:
            algorithm = default_algorithm(name, p, module_reasons, default_patterns)
        if algorithm == "muon" and p.ndim < 2:
            raise ValueError(
                f"routing rule sends {name!r} (shape {tuple(p.shape)}) to Muon, which needs ndim >= 2; "
                "route it to 'adamw'"
            )
        base = dict(muon_options or {}) if algorithm == "muon" else dict(adamw_options or {})
        base.update(options)
        key = (algorithm, tuple(sorted((k, repr(v)) for k, v in base.items())))
        group = groups.setdefault(key, {"params": [], "param_names": [], "algorithm": algorithm, **base})
        group["params"].append(p)
        group["param_names"].append(name)
    unused = [parsed[i][0].pattern for i, hits in enumerate(rule_hits) if hits == 0]
    if unused:
        raise ValueError(
            f"routing rules matched no trainable parameter: {unused}. Check the regex against "
            "model.named_parameters() (rules use re.search on the full name)"
        )
    return list(groups.values())


def default_algorithm(
    name: str,
    p: Tensor,
    module_reasons: Mapping[int, str] | None = None,
    default_patterns: Sequence[re.Pattern[str]] | None = None,
) -> str:
    """'muon' or 'adamw' for one parameter by the default routing (steps 2-5 above)."""
    if p.ndim < 2:
        return "adamw"
    if module_reasons and id(p) in module_reasons:
        return "adamw"
    patterns = default_patterns or [re.compile(x) for x in DEFAULT_ADAMW_PATTERNS]
    if any(regex.search(name) for regex in patterns):
        return "adamw"
    return "muon"


def describe_param_groups(groups: Sequence[Mapping[str, Any]]) -> str:
    """A short table of the routing: per group its algorithm, parameter count, elements, options."""
    lines = [f"{'group':>5}  {'algorithm':<9} {'tensors':>7} {'elements':>13}  options / names"]
    for i, group in enumerate(groups):
        params = group["params"]
        numel = sum(p.numel() for p in params)
        # Hyper-parameters only (an optimizer fills every default into its groups; show the main ones).
        options = {k: group[k] for k in ("lr", "weight_decay") if k in group}
        names = group.get("param_names") or []
        shown = ", ".join(names[:4]) + (f", ... (+{len(names) - 4})" if len(names) > 4 else "")
        lines.append(
            f"{i:>5}  {group.get('algorithm', 'muon'):<9} {len(params):>7} {numel:>13,}  {options or ''} {shown}"
        )
    totals: dict[str, tuple[int, int]] = {}
    for group in groups:
        n, e = totals.get(group.get("algorithm", "muon"), (0, 0))
        totals[group.get("algorithm", "muon")] = (
            n + len(group["params"]),
            e + sum(p.numel() for p in group["params"]),
        )
    lines.append("total: " + "; ".join(f"{a} {n} tensors / {e:,} elements" for a, (n, e) in totals.items()))
    return "\n".join(lines)
