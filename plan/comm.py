"""Communication per GPU per step of a data-parallel layout, and what FSDP2's overlap leaves exposed.

The collectives are counted from the units FSDP2 shards
(``models.laneformer.parallelize.fsdp_units``: embeddings, each block, norm +
head), each unit's buffer padded as FSDP2 pads it (``lane_placement``'s dims).
Per micro batch: an all-gather of every unit's parameters (param dtype) for
the forward, another in the backward for units resharded after forward, a
reduce-scatter of its gradients (reduce dtype) and, under HSDP, an all-reduce
of the reduced shard across replicas; ``[parallel] reduce_grads`` defers the
reductions (all of them, or the all-reduce) to a step's last micro batch.

Bytes and time (NCCL's ring algorithms, at bus bandwidth as nccl-tests
defines it, doc/PERFORMANCE.md in github.com/NVIDIA/nccl-tests): an
all-gather or reduce-scatter of an S-byte buffer over n ranks moves
(n-1)/n * S through each rank, an all-reduce 2(n-1)/n * S. A group inside one
node uses NVLink only. A group with one rank per node (HSDP's replicas) uses
only the network. A group spanning nodes with k ranks in each (FSDP over
every GPU) runs NCCL rings that visit a node's k GPUs over NVLink and leave it
through one NIC, one ring per NIC: 1/k of each GPU's ring traffic crosses its
NIC, the rest stays inside the node. A collective takes the longer of its
NVLink and network shares at the cluster's bus bandwidths.

Overlap, as FSDP2 prefetches: in the forward, unit i+1's all-gather runs during
unit i's compute; in the backward, unit i-1's all-gather (explicit prefetch)
and the reduction of unit i+1 run during unit i's backward. What a window's
collectives take beyond its compute is exposed; the first all-gather of a
forward and the last reduction of a backward are exposed whole. Compute per
unit is the eager roofline's (``roofline.Speed.ops``). Not modelled: per-hop
latency (large messages are bandwidth-bound), NCCL kernels slowing compute,
NVLink and network transfers of different collectives overlapping each other.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from train import recipe as R

from .gpus import GIB
from .roofline import Speed, _shard_dim, _shard_numel

GB = 1e9
KINDS = ("all-gather", "reduce-scatter", "all-reduce")


@dataclass(frozen=True)
class Cluster:
    """Where the GPUs sit: GPUs per node and NCCL bus bandwidths (GB/s) inside a node and per GPU's NIC."""

    name: str
    gpus_per_node: int
    intra_node_gbs: float
    network_gbs: float

    def describe(self) -> str:
        return (f"{self.name}: {self.gpus_per_node} GPUs per node, bus bandwidth {self.intra_node_gbs:g} GB/s "
                f"inside a node, {self.network_gbs:g} GB/s per GPU across nodes")


CLUSTERS = {
    # HGX/DGX H100 with one 400 Gb/s NIC per GPU. NVLink 4: 18 links, 900 GB/s bidirectional per GPU,
    # 450 GB/s each way (NVIDIA H100 Tensor Core GPU datasheet); nccl-tests reach ~360-480 GB/s of bus
    # bandwidth on 8 x H100 SXM: 360 taken. ConnectX-7 NDR InfiniBand: 400 Gb/s = 50 GB/s each way per
    # GPU (NVIDIA ConnectX-7 datasheet); ~45 GB/s (90% of line rate) is the bus bandwidth nccl-tests
    # reach per NIC across nodes.
    "h100-ib400": Cluster("h100-ib400", 8, 360.0, 45.0),
    # HGX A100 with one 200 Gb/s NIC per GPU. NVLink 3: 600 GB/s bidirectional, 300 each way (NVIDIA A100
    # datasheet); nccl-tests ~230 GB/s on 8 x A100 SXM. HDR InfiniBand 200 Gb/s = 25 GB/s; ~22.5 achievable.
    "a100-ib200": Cluster("a100-ib200", 8, 230.0, 22.5),
}


def cluster_for(gpu: str, name: str | None = None, *, gpus_per_node: int | None = None,
                intra_node_gbs: float | None = None, network_gbs: float | None = None) -> Cluster:
    """A preset (default: the one of ``gpu``'s kind) with any of its numbers overridden."""
    name = name or ("a100-ib200" if gpu == "a100" else "h100-ib400")
    if name not in CLUSTERS:
        raise R.RecipeError(f"unknown cluster {name!r}; known: {', '.join(CLUSTERS)}")
    base = CLUSTERS[name]
    changed = {k: v for k, v in (("gpus_per_node", gpus_per_node), ("intra_node_gbs", intra_node_gbs),
                                 ("network_gbs", network_gbs)) if v is not None}
    for key, value in changed.items():
        if value <= 0:
            raise R.RecipeError(f"--{key.replace('_', '-')}: must be > 0 (got {value})")
    label = base.name + (" with " + ", ".join(f"{k}={v:g}" for k, v in changed.items()) if changed else "")
    return Cluster(label, changed.get("gpus_per_node", base.gpus_per_node),
                   changed.get("intra_node_gbs", base.intra_node_gbs), changed.get("network_gbs", base.network_gbs))


@dataclass(frozen=True)
class Layout:
    """A data-parallel layout: ``[parallel]``'s shard, replicate, reshard_after_forward and reduce_grads."""

    replicate: int
    shard: int
    reshard_after_forward: str = "default"
    reduce_grads: str = "every_micro_batch"

    @classmethod
    def of(cls, recipe: R.Recipe, gpus: int) -> Layout:
        """The recipe's layout on ``gpus`` GPUs: parameters are sharded over ``shard x context_parallel``
        ranks, as torchtitan folds the CP ranks into the FSDP mesh (``ParallelDims``' ``fsdp``)."""
        replicate, shard = R.dp_degrees(recipe, gpus)
        p = recipe.parallel
        return cls(replicate, shard * p.context_parallel, p.reshard_after_forward, p.reduce_grads)

    @property
    def name(self) -> str:
        return f"HSDP {self.replicate} x {self.shard}" if self.replicate > 1 else f"FSDP over {self.shard}"

    def describe(self) -> str:
        return (f"{self.name} (shard {self.shard}, replicate {self.replicate}), reshard_after_forward "
                f"{self.reshard_after_forward}, reduce_grads {self.reduce_grads}")

    def recipe_lines(self) -> list[str]:
        return [f"shard = {self.shard}", f"replicate = {self.replicate}",
                f'reshard_after_forward = "{self.reshard_after_forward}"', f'reduce_grads = "{self.reduce_grads}"']


def candidate_layouts(gpus: int, gpus_per_node: int) -> list[Layout]:
    """What ``--sweep`` ranks: FSDP over every GPU and, beyond one node, HSDP sharded inside each
    node; each with every reshard policy and gradient reduction that applies."""
    degrees = [(1, gpus)] + ([(gpus // gpus_per_node, gpus_per_node)] if gpus > gpus_per_node else [])
    return [Layout(r, s, reshard, reduce) for r, s in degrees for reshard in ("default", "always", "never")
            for reduce in R.REDUCE_GRADS if r > 1 or reduce != "replicas_last_micro_batch"]


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: its gathered (padded) elements, one rank's shard, resharded after forward."""

    name: str
    numel: int
    shard_numel: int
    resharded: bool


_META: dict[int, tuple[object, torch.nn.Module]] = {}


def _meta_model(config) -> torch.nn.Module:
    """The model on the meta device, built once per config object (a sweep asks hundreds of times;
    the config is kept with it, so its id is not reused)."""
    if (hit := _META.get(id(config))) is None or hit[0] is not config:
        with torch.device("meta"):
            hit = _META[id(config)] = (config, config.build())
    return hit[1]


def fsdp_units(config, layout: Layout) -> list[Unit]:
    """The model's FSDP units in forward order, as ``parallelize.apply_fsdp`` shards them."""
    from models.laneformer.parallelize import fsdp_units as units, lane_placement

    model = _meta_model(config)
    placement = lane_placement(config.n_lanes, layout.shard)
    out = []
    for name, modules, resharded in units(model, layout.reshard_after_forward):
        shard = sum(_shard_numel(p, _shard_dim(placement, p), layout.shard)
                    for m in modules for p in m.parameters())
        out.append(Unit(name, shard * layout.shard, shard, resharded))
    return out


@dataclass
class Traffic:
    """Bytes through one GPU and seconds, of one or several collectives."""

    intra: float = 0.0
    network: float = 0.0
    seconds: float = 0.0

    def __iadd__(self, other: Traffic) -> Traffic:
        self.intra += other.intra
        self.network += other.network
        self.seconds += other.seconds
        return self


def collective(kind: str, size: float, ranks: int, per_node: int, cluster: Cluster) -> Traffic:
    """One ring collective of an ``size``-byte buffer (the gathered or reduced whole) over ``ranks``
    ranks, ``per_node`` of them in each node they span."""
    if ranks == 1:
        return Traffic()
    bus = (2 if kind == "all-reduce" else 1) * (ranks - 1) / ranks * size
    network = 0.0 if per_node == ranks else bus / per_node  # one NIC crossing per node and ring
    intra = bus - network
    return Traffic(intra, network, max(intra / (cluster.intra_node_gbs * GB), network / (cluster.network_gbs * GB)))


def group_spread(layout: Layout, gpus_per_node: int) -> tuple[int, int]:
    """Ranks per node of (a shard group, a replica group): ranks are numbered replica-major
    (torchtitan's ``(dp_replicate, fsdp)`` mesh) and fill nodes in order."""
    gpn, shard = gpus_per_node, layout.shard
    if shard % gpn and gpn % shard:
        raise R.RecipeError(f"[parallel] shard: {shard} neither fills whole nodes of {gpn} GPUs nor divides one")
    return min(shard, gpn), max(1, gpn // shard)


@dataclass
class Communication:
    """One layout's communication per GPU per step, and the step with what stays exposed."""

    layout: Layout
    cluster: Cluster
    gpus: int
    accumulation: int
    by_kind: dict[str, Traffic]
    exposed_s: float
    speed: Speed  # the eager roofline the overlap is measured against
    held_bytes: int  # kept across micro batches by reduce_grads
    gathered_bytes: int  # kept gathered from forward to backward beyond what the traced policy keeps

    @property
    def network_bytes(self) -> float:
        return sum(t.network for t in self.by_kind.values())

    @property
    def intra_bytes(self) -> float:
        return sum(t.intra for t in self.by_kind.values())

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.by_kind.values())

    @property
    def step_s(self) -> float:
        return self.speed.step_s + self.exposed_s

    @property
    def tokens_per_s(self) -> float:
        return self.speed.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        return self.speed.flops_per_token * self.tokens_per_s / self.speed.peak_flops

    @property
    def extra_memory(self) -> int:
        """Bytes per GPU the traced peak (reduce every micro batch, default resharding) does not hold."""
        return self.held_bytes + self.gathered_bytes

    def lines(self) -> list[str]:
        nodes = max(1, self.gpus // self.cluster.gpus_per_node)
        lines = [f"communication per GPU per step: {self.layout.describe()}, gradient accumulation {self.accumulation}, "
                 f"on {self.gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''}; cluster {self.cluster.describe()})"]
        lines.append(f"  gradient reduction: {R.REDUCE_GRADS[self.layout.reduce_grads]}")
        for kind, t in self.by_kind.items():
            lines.append(f"  {kind}: {t.intra / GB:.3g} GB intra-node, {t.network / GB:.3g} GB network, "
                         f"{t.seconds:.3g} s")
        held = {"last_micro_batch": "unsharded gradients", "replicas_last_micro_batch": "sharded partial sums"}
        if self.held_bytes:
            lines.append(f"held across micro batches ({held[self.layout.reduce_grads]}, reduce dtype): "
                         f"{self.held_bytes / GIB:.2f} GiB per GPU, on top of the traced peak")
        if self.gathered_bytes:
            lines.append(f"kept gathered from forward to backward (reshard_after_forward never): "
                         f"{self.gathered_bytes / GIB:.2f} GiB per GPU, on top of the traced peak")
        return lines + self.figures() + [
            "  (assumes: NCCL ring collectives at the cluster's bus bandwidths, a ring spanning nodes crossing "
            "each node once per NIC; overlap per FSDP unit as FSDP2 prefetches, against the eager roofline's "
            "per-unit compute; the first all-gather and the last reduction of each micro batch exposed; no "
            "per-hop latency)",
        ]

    def figures(self) -> list[str]:
        """The lines the issue's targets and the recipes' comments quote."""
        return [
            f"network bytes per GPU per step: {self.network_bytes / GB:.3g} GB",
            f"intra-node bytes per GPU per step: {self.intra_bytes / GB:.3g} GB",
            f"communication time if nothing overlapped: {self.seconds:.3g} s",
            f"exposed communication per step: {self.exposed_s:.3g} s ({self.exposed_s / self.step_s:.1%} of the step)",
            f"roofline with communication: {self.tokens_per_s:,.0f} tokens/s/GPU, MFU {self.mfu:.1%}",
        ]

    def to_json(self) -> dict:
        return {"layout": vars(self.layout) | {"name": self.layout.name}, "cluster": vars(self.cluster),
                "network_gb": self.network_bytes / GB, "intra_node_gb": self.intra_bytes / GB,
                "by_kind": {k: {"intra_node_gb": t.intra / GB, "network_gb": t.network / GB, "seconds": t.seconds}
                            for k, t in self.by_kind.items()},
                "seconds": self.seconds, "exposed_s": self.exposed_s, "step_s": self.step_s,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "extra_memory_gib": self.extra_memory / GIB}


def _unit_compute(speed: Speed, units: list[Unit]) -> tuple[dict[str, float], dict[str, float]]:
    """Forward and backward (recomputation included) seconds of one micro batch per unit; ops
    outside every unit (the loss) count with the head, which runs next to them."""
    forward, backward = defaultdict(float), defaultdict(float)
    head = units[-1].name
    prefixes = {u.name: u.name for u in units if u.name.startswith("layers.")}
    for op in speed.ops:
        if op.phase == "optimizer":
            continue
        unit = head
        if op.where.startswith("tok_embeddings"):
            unit = units[0].name
        elif op.where.startswith("layers."):
            unit = prefixes[".".join(op.where.split(".")[:2])]
        (forward if op.phase == "forward" else backward)[unit] += op.seconds
    return forward, backward


def communication(config, layout: Layout, speed: Speed, cluster: Cluster, *, gpus: int, accumulation: int,
                  param_dtype: str, reduce_dtype: str) -> Communication:
    """Bytes, seconds and exposed seconds of one step's collectives on ``gpus`` GPUs of ``cluster``."""
    if gpus > cluster.gpus_per_node and gpus % cluster.gpus_per_node:
        raise R.RecipeError(f"--gpus {gpus} is not a whole number of nodes of {cluster.gpus_per_node} GPUs "
                            "(--gpus-per-node)")
    units = fsdp_units(config, layout)
    p_bytes, r_bytes = (torch.empty((), dtype=getattr(torch, d)).element_size() for d in (param_dtype, reduce_dtype))
    per_shard_group, per_replica_group = group_spread(layout, min(gpus, cluster.gpus_per_node))
    gather = [collective("all-gather", u.numel * p_bytes, layout.shard, per_shard_group, cluster) for u in units]
    scatter = [collective("reduce-scatter", u.numel * r_bytes, layout.shard, per_shard_group, cluster) for u in units]
    all_reduce = [collective("all-reduce", u.shard_numel * r_bytes, layout.replicate, per_replica_group, cluster)
                  for u in units]
    forward, backward = _unit_compute(speed, units)
    by_kind = {k: Traffic() for k in KINDS}
    exposed, mode, n = 0.0, layout.reduce_grads, len(units)
    for m in range(accumulation):
        last = m == accumulation - 1
        scatters, all_reduces = mode != "last_micro_batch" or last, mode == "every_micro_batch" or last
        regather = [g.seconds if u.resharded else 0.0 for u, g in zip(units, gather)]
        reduction = [s.seconds * scatters + a.seconds * all_reduces for s, a in zip(scatter, all_reduce)]
        for i, u in enumerate(units):
            by_kind["all-gather"] += gather[i]
            if u.resharded:
                by_kind["all-gather"] += gather[i]
            if scatters:
                by_kind["reduce-scatter"] += scatter[i]
            if all_reduces:
                by_kind["all-reduce"] += all_reduce[i]
        # forward: unit i's compute hides unit i+1's all-gather; the first one is exposed
        exposed += gather[0].seconds + sum(max(0.0, gather[i].seconds - forward[units[i - 1].name])
                                           for i in range(1, n))
        # backward, last unit first: unit i's backward hides unit i-1's all-gather and unit i+1's
        # reduction; the first all-gather and the last reduction are exposed
        exposed += regather[n - 1] + reduction[0]
        exposed += sum(max(0.0, (regather[i - 1] if i > 0 else 0.0) + (reduction[i + 1] if i + 1 < n else 0.0)
                           - backward[units[i].name]) for i in range(n))
    held = 0
    if accumulation > 1 and mode == "last_micro_batch":
        held = sum(u.numel for u in units) * r_bytes
    elif accumulation > 1 and mode == "replicas_last_micro_batch" and layout.replicate > 1:
        held = sum(u.shard_numel for u in units) * r_bytes
    traced = fsdp_units(config, Layout(layout.replicate, layout.shard))  # the memory trace's default policy
    gathered = sum(u.numel * p_bytes for u, t in zip(units, traced) if t.resharded and not u.resharded)
    return Communication(layout, cluster, gpus, accumulation, by_kind, exposed, speed, held, gathered)
