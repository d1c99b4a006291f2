"""Per-rank bodies of the distributed dmuon tests, and their single-process references.

The model mixes everything the distributed path must handle: rows that do not divide by 2 or 4,
a matrix with fewer rows than ranks (an empty shard on 4 ranks), 3-D and 4-D weights, several
same-shape matrices (batched NS), and AdamW params (embedding, norm, biases).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dmuon

GLOBAL_BATCH = 8
STEPS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 12)
        self.fc_in = nn.Linear(12, 37)  # 37 rows: uneven on 2 and 4 ranks
        self.norm = nn.LayerNorm(37)
        self.blocks = nn.ModuleList(nn.Linear(37, 37, bias=False) for _ in range(3))  # same-shape batch
        self.conv1d = nn.Conv1d(4, 6, 3)  # 3-D weight (6, 4, 3)
        self.conv2d = nn.Conv2d(3, 5, 2)  # 4-D weight (5, 3, 2, 2)
        self.mix = nn.Linear(37 + 6 + 5, 19)
        self.head = nn.Linear(19, 3)  # (3, 19): 3 rows -> an empty shard on 4 ranks (routed to Muon)

    def forward(self, tokens: torch.Tensor, signal: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc_in(self.embed(tokens).mean(1)))
        h = self.norm(h)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        c1 = self.conv1d(signal).mean(-1)
        c2 = self.conv2d(image).mean((-1, -2))
        return self.head(torch.tanh(self.mix(torch.cat([h, c1, c2], dim=-1))))


def make_model() -> Net:
    torch.manual_seed(1234)
    return Net()


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, ...]:
    """This rank's slice of the global batch of `step` (equal slices, so mean-of-means = mean)."""
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 11, (GLOBAL_BATCH, 5), generator=gen)
    signal = torch.randn(GLOBAL_BATCH, 4, 8, generator=gen)
    image = torch.randn(GLOBAL_BATCH, 3, 4, 4, generator=gen)
    target = torch.randn(GLOBAL_BATCH, 3, generator=gen)
    per = GLOBAL_BATCH // world
    return tuple(t[rank * per : (rank + 1) * per] for t in (tokens, signal, image, target))


def routing_rules() -> list[dict]:
    # The head is a plain hidden-size projection here; route it to Muon to exercise the empty shard.
    return [{"pattern": r"^head\.weight$", "algorithm": "muon"}]


def make_optimizer(model: nn.Module, **options: Any) -> dmuon.Muon:
    ns = {k: options.pop(k) for k in list(options) if k.startswith("ns_")}
    return dmuon.Muon(
        dmuon.param_groups(model, routing_rules()),
        lr=0.05,
        weight_decay=0.01,
        adamw_lr=1e-2,
        adamw_weight_decay=0.01,
        **{"ns_algorithm": "standard", **ns},
        **options,
    )


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0, world: int = 1) -> None:
    for step in steps:
        tokens, signal, image, target = batch(step, rank, world)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(tokens, signal, image), target).backward()
        opt.step()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def reference(steps: int = STEPS, **options: Any) -> dict[str, torch.Tensor]:
    """Single-process dmuon.Muon on the full tensors and the global batch."""
    model = make_model()
    train(model, make_optimizer(model, **options), range(steps))
    return full_params(model)


def _fsdp(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for module in (model.fc_in, *model.blocks, model.conv1d, model.conv2d, model.mix, model.head):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _plan_info(opt: dmuon.Muon) -> list[dict]:
    return [
        {
            "digest": p.digest(),
            "owners": p.owners,
            "members": p.members,
            "world": p.world,
            "names": [s.name for s in p.specs],
            "buckets": p.buckets,
            "split": [p.specs[i].name for i in p.split_indices],
        }
        for p in opt.plans()
    ]


def fsdp_scenarios(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 (standard + LPT, gram + MILP, tiny buckets with and without overlap), DDP, param swap."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, Any] = {}

    variants = {
        "fsdp_standard_lpt": {"ns_algorithm": "standard", "planner": "lpt"},
        "fsdp_gram_milp": {"ns_algorithm": "gram", "planner": "milp"},
        "fsdp_buckets_overlap": {"ns_algorithm": "standard", "bucket_mb": 0.004, "overlap": True},
        "fsdp_buckets_serial": {"ns_algorithm": "standard", "bucket_mb": 0.004, "overlap": False},
    }
    for key, options in variants.items():
        model = _fsdp(make_model(), mesh)
        opt = make_optimizer(model, **options)
        train(model, opt, range(STEPS), rank, world)
        results[key] = full_params(model)
        results[key + "/plans"] = _plan_info(opt)
        if key == "fsdp_standard_lpt":
            p = model.fc_in.weight
            state = opt.state[p]["momentum_buffer"]
            results["state_is_sharded"] = (
                type(state).__name__ == "DTensor" and state.to_local().shape == p.to_local().shape
            )
            results["plan_table"] = opt.plan_summary()

    # Accelerate-style swap: optimizer built on plain params, then the model is sharded and the
    # groups' entries replaced by the new DTensor params (Accelerate does not remap state).
    model = make_model()
    opt = make_optimizer(model)
    names = {id(p): n for n, p in model.named_parameters()}
    group_names = [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
    model = _fsdp(model, mesh)
    live = dict(model.named_parameters())
    for group, gnames in zip(opt.param_groups, group_names):
        group["params"] = [live[n] for n in gnames]
    train(model, opt, range(STEPS), rank, world)
    results["fsdp_swapped"] = full_params(model)

    if world > 1:
        for key, ns_algorithm in (("ddp", "standard"), ("ddp_gram", "gram")):
            model = DDP(make_model())
            opt = make_optimizer(model.module, ns_algorithm=ns_algorithm)
            train(model, opt, range(STEPS), rank, world)
            results[key] = full_params(model.module)
            results[key + "/plans"] = _plan_info(opt)
    return results


def hsdp_scenario(rank: int, world: int, ns_algorithm: str) -> dict[str, Any]:
    """HSDP on a (2 replicate x 2 shard) mesh: replicas sharing the work (split off / always, with
    and without overlap), and the older every-replica-repeats path."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    from dmuon.planner import CostModel

    # Replicas on two nodes whose link is slow next to Newton-Schulz: "auto" has every replica
    # compute all matrices itself (owners), or (split) keeps some buckets shared and computes the
    # others itself, both kinds in one step. Values found by trying the planner on this model.
    slowest = CostModel(flops_per_second=1e8, ranks_per_node=world // 2, inter_node_bandwidth=2e5)
    slow = CostModel(flops_per_second=1e8, ranks_per_node=world // 2, inter_node_bandwidth=5e5)
    variants = {
        "share": {"split": "off", "hsdp_replicas": "share"},
        "share_split": {"split": "always", "hsdp_replicas": "share"},
        "share_split_serial": {
            "split": "always",
            "overlap": False,
            "bucket_mb": 0.004,
            "hsdp_replicas": "share",
        },
        "share_buckets": {"split": "off", "bucket_mb": 0.004, "hsdp_replicas": "share"},
        "repeat": {"hsdp_replicas": "repeat"},
        "auto_local": {"hsdp_replicas": "auto", "cost_model": slowest, "bucket_mb": 0.004},
        "auto_mixed_split": {
            "hsdp_replicas": "auto",
            "cost_model": slow,
            "split": "always",
            "bucket_mb": 0.004,
        },
    }
    results: dict[str, Any] = {}
    for key, options in variants.items():
        model = _fsdp(make_model(), mesh)
        results["placements"] = tuple(type(pl).__name__ for pl in model.fc_in.weight.placements)
        opt = make_optimizer(model, ns_algorithm=ns_algorithm, **options)
        train(model, opt, range(STEPS), rank, world)
        results[key] = {
            "params": full_params(model),
            "local": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
            "plans": _plan_info(opt),
            "table": opt.plan_summary(),
            "sharing": [p.bucket_replicas for p in opt.plans()],
        }
    return results


def split_scenarios(rank: int, world: int, ns_algorithm: str) -> dict[str, Any]:
    """split="always" under FSDP2 (pipelined and serial, tiny buckets) and DDP: every Muon matrix is
    orthogonalised by all ranks together, each on a column chunk."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, Any] = {}
    variants = {
        "fsdp_split": {"split": "always"},
        "fsdp_split_buckets_serial": {"split": "always", "bucket_mb": 0.004, "overlap": False},
        "fsdp_split_buckets_overlap": {"split": "always", "bucket_mb": 0.004},
    }
    for key, options in variants.items():
        model = _fsdp(make_model(), mesh)
        opt = make_optimizer(model, ns_algorithm=ns_algorithm, **options)
        train(model, opt, range(STEPS), rank, world)
        results[key] = full_params(model)
        results[key + "/plans"] = _plan_info(opt)
        results[key + "/table"] = opt.plan_summary()
    model = DDP(make_model())
    opt = make_optimizer(model.module, ns_algorithm=ns_algorithm, split="always")
    train(model, opt, range(STEPS), rank, world)
    results["ddp_split"] = full_params(model.module)
    results["ddp_split/plans"] = _plan_info(opt)
    return results


def dcp_save(rank: int, world: int, directory: str, steps_before: int) -> dict[str, Any]:
    """Train FSDP for `steps_before` steps, save model + optimizer with DCP, then train one more."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp(make_model(), mesh)
    opt = make_optimizer(model)
    train(model, opt, range(steps_before), rank, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    dist.barrier()
    train(model, opt, range(steps_before, steps_before + 1), rank, world)
    return full_params(model)


def dcp_resume(rank: int, world: int, directory: str, steps_before: int) -> dict[str, Any]:
    """Load the checkpoint on `world` ranks (resharding) and train the next step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp(make_model(), mesh)
    opt = make_optimizer(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(model, opt, range(steps_before, steps_before + 1), rank, world)
    return full_params(model)


def diverging_plans(rank: int, world: int) -> None:
    """Rank 1 holds an extra Muon matrix with a gradient: the plans differ and step() must raise."""
    extra = nn.Parameter(torch.randn(4, 4)) if rank == 1 else None
    params = [nn.Parameter(torch.randn(6, 6))] + ([extra] if extra is not None else [])
    opt = dmuon.Muon(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


def failing_rank(rank: int, world: int) -> None:
    """Rank 1 dies before a collective that rank 0 then waits on."""
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()


def hanging_rank(rank: int, world: int) -> None:
    """Rank 1 waits in a barrier that rank 0, asleep, never reaches: a hang, not a failure."""
    if rank == 0:
        time.sleep(120)
    dist.barrier()


def spins_the_first_time(rank: int, world: int, flag_dir: str | None) -> int:
    """On the first run (no flag file yet; every run if flag_dir is None) rank 1 spins forever and
    rank 0 waits for it in a barrier; on a later run both return their rank."""
    flag = Path(flag_dir) / "spun" if flag_dir is not None else None
    first = flag is None or not flag.exists()
    dist.barrier()  # every rank has read the flag before rank 1 writes it
    if first:
        if rank == 1:
            if flag is not None:
                flag.write_text("")
            while True:  # the gloo TCP loop's spin, as the kernel sees it: CPU time without end
                pass
        dist.barrier()
    return rank


def copy_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def calibrated_cost_model(rank: int, world: int, cache_dir: str) -> dict[str, Any]:
    """cost_model="calibrated": rank 0 measures (and caches) NS timings; every rank plans alike."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    os.environ["DMUON_CACHE"] = cache_dir
    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp(make_model(), mesh)
    opt = make_optimizer(model, cost_model="calibrated", planner="milp")
    train(model, opt, range(STEPS), rank, world)
    return {"params": full_params(model), "plans": _plan_info(opt), "cache": sorted(os.listdir(cache_dir))}


def pinned_process_group(rank: int, world: int) -> dict[str, Any]:
    """Two independent DDP-style jobs in one world: ranks {0,1} and {2,3}, each pinned to its group."""
    group, _ = dist.new_subgroups(2)
    job = rank // 2
    torch.manual_seed(job)
    params = [
        nn.Parameter(torch.randn(9, 5)),
        nn.Parameter(torch.randn(4, 4, 2)),
        nn.Parameter(torch.randn(7, 7)),
    ]
    opt = dmuon.Muon(params, lr=0.1, process_group=group, ns_algorithm="standard")
    for step in range(2):
        gen = torch.Generator().manual_seed(1000 * job + step)  # same grads within a job
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return {"job": job, "params": [p.detach().clone() for p in params], "plans": _plan_info(opt)}


def pinned_reference(job: int) -> list[torch.Tensor]:
    torch.manual_seed(job)
    params = [
        nn.Parameter(torch.randn(9, 5)),
        nn.Parameter(torch.randn(4, 4, 2)),
        nn.Parameter(torch.randn(7, 7)),
    ]
    opt = dmuon.Muon(params, lr=0.1, ns_algorithm="standard")
    for step in range(2):
        gen = torch.Generator().manual_seed(1000 * job + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


def unsupported_layouts(rank: int, world: int) -> dict[str, str]:
    """Shard(1) and a pinned mesh mismatch: clear errors naming the param, on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    errors = {}
    column = nn.Parameter(distribute_tensor(torch.randn(6, 8), mesh, [Shard(1)]))
    opt = dmuon.Muon([("proj.weight", column)], lr=0.1)
    column.grad = distribute_tensor(torch.ones(6, 8), mesh, [Shard(1)])
    try:
        opt.step()
    except ValueError as exc:
        errors["shard1"] = str(exc)
    other_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("other",))
    row = nn.Parameter(distribute_tensor(torch.randn(6, 8), mesh, [Shard(0)]))
    row.grad = distribute_tensor(torch.ones(6, 8), mesh, [Shard(0)])
    pinned = dmuon.Muon([("fc.weight", row)], lr=0.1, device_mesh=other_mesh)
    try:
        pinned.step()
    except ValueError as exc:
        errors["pinned"] = str(exc)
    return errors


def split_ns_cases(rank: int, world: int) -> dict[str, Any]:
    """dmuon.split_ns on this rank's column chunk vs single-process newton_schulz on the whole batch,
    and the number of collectives each call made (to check split_collectives)."""
    from dmuon import split_ns
    from dmuon.newton_schulz import coefficient_schedule, newton_schulz

    counts = {"all_reduce": 0, "all_gather": 0}
    real_reduce, real_gather = split_ns._all_reduce, split_ns._all_gather

    def counting_reduce(t, group):
        counts["all_reduce"] += 1
        return real_reduce(t, group)

    def counting_gather(*args, **kwargs):
        counts["all_gather"] += 1
        return real_gather(*args, **kwargs)

    split_ns._all_reduce, split_ns._all_gather = counting_reduce, counting_gather
    out: dict[str, Any] = {}
    # (batch, m, n): m < world (empty row blocks of the m x m products), n < world (empty column
    # chunks), uneven chunks, a batch.
    for batch, m, n in [(1, 5, 12), (3, 9, 40), (2, 3, 19), (1, 2, 3), (1, 16, 64)]:
        gen = torch.Generator().manual_seed(batch * 1000 + m * 10 + n)
        G = torch.randn(batch, m, n, generator=gen)
        sizes = split_ns.chunk_sizes(n, world)
        start = sum(sizes[:rank])
        for algorithm in ("standard", "gram"):
            for coefficients in ("jordan", "polar_express"):
                counts.update(all_reduce=0, all_gather=0)
                got = split_ns.split_newton_schulz(
                    G[:, :, start : start + sizes[rank]].clone(),
                    coefficient_schedule(coefficients, 5),
                    algorithm=algorithm,
                    group=None,
                    members=world,
                    index=rank,
                    m=m,
                    eps=1e-7,
                )
                expected = newton_schulz(G, algorithm=algorithm, coefficients=coefficients)
                key = f"{batch}x{m}x{n}/{algorithm}/{coefficients}"
                out[key] = {
                    "got": got,
                    "expected": expected[:, :, start : start + sizes[rank]],
                    "counts": (counts["all_reduce"], counts["all_gather"]),
                    "predicted": split_ns.split_collectives(algorithm, 5),
                }
    split_ns._all_reduce, split_ns._all_gather = real_reduce, real_gather
    return out


def exchange_cases(rank: int, world: int, ranks_per_node: int) -> dict[str, Any]:
    """dmuon.exchange on its own: ragged all-to-alls with a seeded size matrix (zeros, self chunks,
    empty rows), flat and two-level, forward and transposed, fp32 and a bf16 wire. Each element
    encodes (source, destination, index), so the received buffer says where every value came from.
    Also records the group sizes of the all_to_all_single calls made."""
    from dmuon import exchange as ex

    gen = torch.Generator().manual_seed(7)
    matrix = torch.randint(0, 5, (world, world), generator=gen)
    matrix[matrix == 1] = 0  # some pairs send nothing
    matrix[world - 1] = 0  # one rank sends nothing at all
    ranks = list(range(world))
    layout = ex.node_layout(ranks, ranks_per_node)

    def payload(m: torch.Tensor) -> torch.Tensor:
        parts = [
            torch.arange(int(m[rank, t]), dtype=torch.float32) + 1000 * rank + 100 * t for t in range(world)
        ]
        return torch.cat(parts)

    calls: list[int] = []
    original = dist.all_to_all_single

    def recording(*args, **kwargs):
        calls.append(dist.get_world_size(kwargs.get("group")))
        return original(*args, **kwargs)

    out: dict[str, Any] = {"layout": layout}
    dist.all_to_all_single = recording
    try:
        for direction, m in (("forward", matrix), ("return", matrix.T.contiguous())):
            for name, lay in (("flat", None), ("two_level", layout)):
                for wire in (None, torch.bfloat16):
                    calls.clear()
                    exchange = ex.Exchange(m, rank, dist.group.WORLD, ranks, lay, wire)
                    pending = exchange.start(payload(m), async_op=True)
                    pending.advance()
                    key = f"{direction}/{name}/{'bf16' if wire else 'fp32'}"
                    out[key] = pending.wait()
                    out[key + "/groups"] = list(calls)
        expected = torch.cat(
            [
                torch.arange(int(matrix[s, rank]), dtype=torch.float32) + 1000 * s + 100 * rank
                for s in range(world)
            ]
        )
        out["expected_forward"] = expected
    finally:
        dist.all_to_all_single = original
    return out


def two_level_scenarios(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 over all ranks seen as nodes of 2 (ranks_per_node=2): the two-level exchange, pipelined
    and serial, with split matrices, against the flat one; and the bf16 wire (FSDP2 and HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    variants = {
        "flat": {"exchange": "flat", "bucket_mb": 0.004},
        "two_level": {"exchange": "two_level", "ranks_per_node": 2, "bucket_mb": 0.004},
        "two_level_serial": {
            "exchange": "two_level",
            "ranks_per_node": 2,
            "bucket_mb": 0.004,
            "overlap": False,
        },
        "flat_split": {"exchange": "flat", "split": "always", "bucket_mb": 0.004},
        "two_level_split": {
            "exchange": "two_level",
            "ranks_per_node": 2,
            "split": "always",
            "bucket_mb": 0.004,
        },
        "auto_one_node": {"exchange": "auto", "ranks_per_node": world},
        "wire_bf16": {"exchange": "two_level", "ranks_per_node": 2, "wire_dtype": torch.bfloat16},
        "wire_bf16_all": {"exchange": "flat", "wire_dtype": torch.bfloat16, "wire_scope": "all"},
    }
    results: dict[str, Any] = {}
    for key, options in variants.items():
        model = _fsdp(make_model(), mesh)
        opt = make_optimizer(model, **options)
        train(model, opt, range(STEPS), rank, world)
        results[key] = full_params(model)
        results[key + "/plans"] = _plan_info(opt)
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = _fsdp(make_model(), hsdp)
    opt = make_optimizer(model, wire_dtype="bfloat16")
    train(model, opt, range(STEPS), rank, world)
    results["hsdp_wire_bf16"] = full_params(model)
    results["hsdp_wire_bf16/local"] = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    return results
