"""Greedy decoding with a KV cache, in one process or lane-parallel with the delayed exchange.

    python -m models.laneformer.generate --checkpoint DIR --prompt TEXT --max-new-tokens N
    torchrun --nproc-per-node P -m models.laneformer.generate --checkpoint DIR --prompt TEXT \\
        --max-new-tokens N --lane-parallel

``DIR`` is an exported Hugging Face folder, or a run dir / DCP step dir (also
one that ``convert from-hf`` wrote). Without ``--lane-parallel`` one process
holds every lane: the reference. With it, ``P`` ranks (``P`` divides
``n_lanes``) each hold lanes ``r*L/P .. (r+1)*L/P - 1``: their slices
``W[lanes]`` of every lane-batched weight (read straight from the released
``[L, out, in]`` layout, no conversion), the KV cache of their own heads, and
the replicated embeddings, norm and head. A window layer caches only its window
(a ring), a full layer every position; the RoPE tables are as long as the
decode, so it runs past ``max_seq_len`` (``LaneDecoder.reset`` says why that is
the model's own RoPE). For sub-block ``s`` (attention,
then MLP) of layer ``i``, with ``o_l(i)`` lane ``l``'s partial output and
``S_r(i) = sum_{l on rank r} o_l(i)``, each rank computes, for its lanes::

    T(i) = all_reduce(S_r(i))                   = sum over all L lanes m of o_m(i)
    present:  x_l += T(i)                       (reduced at once)
    scaled:   x_l += sqrt(L) * o_l(i)           (no exchange)
    own:      x_l += o_l(i)
    if layer i sends:  T(i) is started with async_op=True (present: already reduced), o_l(i) kept
    if layer i-delay sent:  wait T(i-delay);  x_l += T(i-delay) - o_l(i-delay)    (= sum_{m != l} o_m(i-delay))
    after the last layer:   x_l += T(j) - o_l(j) for each send j still in flight   (late_mode "flush" only)
    final, last position only, one reduction of [D] vectors:
        mean_of_norms: h = all_reduce(sum_{l on r} RMSNorm(x_l)) / L
        norm_of_sum:   h = RMSNorm(all_reduce(sum_{l on r} x_l))
    next token = argmax(lm_head(h))             (the same on every rank: so are the reductions)

Which rule a layer uses, and whether it sends, is ``Laneformer.Config.exchange_of``:
the decoder follows the model config exactly. Prefill runs the same split over
the prompt. Rank 0 prints the text, ``ids: ...`` and the timing: per-token
latency, each rank's time blocked on the exchange against its compute, and the
same decode with ``delay=0`` (a synchronous all-reduce per sub-block: standard
tensor parallelism, a different model, timed only) as a ratio. On CUDA the
wait/compute split comes from a second, synchronised pass, so that the latency
is measured without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checkpoint import LANE_WEIGHT, open_checkpoint, parse_overrides
from .model import Laneformer


# --- weights ---------------------------------------------------------------------------------------


def random_weights(config: Laneformer.Config, lanes: range, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random model's tensors, made lane by lane, so a rank makes only its own slices.

    Every (tensor, lane) has its own seeded generator: any lane split gives the
    same model. For tests and benchmarks of models too large to hold P times.
    """
    from .hf.checkpoint_io import expected_shapes

    out = {}
    for n, (name, shape) in enumerate(sorted(expected_shapes(config).items())):
        def normal(tensor, std, part=0):  # in place: a 2B-shaped model's 0.7B lane values, with no copies
            return tensor.normal_(0, std, generator=torch.Generator().manual_seed(seed * 1_000_003 + n * 1009 + part))

        if LANE_WEIGHT.fullmatch(name):  # unit-variance outputs, so that every layer and exchange shows
            out[name] = torch.empty(len(lanes), *shape[1:])
            for i, lane in enumerate(lanes):
                normal(out[name][i], shape[2] ** -0.5, part=lane)
        elif name.endswith("norm.weight"):
            out[name] = normal(torch.empty(shape), 0.1).add_(1)
        elif name == "lm_head.weight":
            out[name] = normal(torch.empty(shape), config.dim**-0.5)
        else:
            out[name] = normal(torch.empty(shape), 1.0)
    return out


def lane_range(n_lanes: int, rank: int, world: int) -> range:
    if n_lanes % world:
        raise ValueError(f"{world} ranks must divide model.n_lanes={n_lanes} (use 1, 2, 4 or 8 for 8 lanes)")
    per = n_lanes // world
    return range(rank * per, (rank + 1) * per)


# --- one rank's lanes ----------------------------------------------------------------------------


def lane_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[B, S, n, in] x [n, out, in] -> [B, S, n, out]: each lane with its own weight."""
    return torch.einsum("bsli,loi->bslo", x, w)


@dataclasses.dataclass
class _Sent:
    """A sub-block's send: the (being) reduced sum over lanes, the collective, this rank's own outputs."""

    total: torch.Tensor
    work: dist.Work | None
    own: torch.Tensor


class LaneDecoder:
    """Lanes ``lanes`` of a Laneformer with a KV cache; the other lanes live on the other ranks of ``group``.

    ``group=None``: one process holding every lane (all reductions are local sums).
    """

    def __init__(self, config: Laneformer.Config, weights: dict[str, torch.Tensor], lanes: range,
                 device: torch.device, dtype: torch.dtype = torch.float32, group=None):
        self.cfg, self.lanes, self.group, self.device, self.dtype = config, lanes, group, device, dtype
        self.L, n = config.n_lanes, len(lanes)
        self.heads, self.kv_heads = config.n_heads * n // self.L, config.n_kv_heads * n // self.L
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        for name, t in self.w.items():
            if LANE_WEIGHT.fullmatch(name) and t.shape[0] != n:
                raise ValueError(f"{name}: holds {t.shape[0]} lanes, this rank owns {n} ({lanes})")
        self.ropes: list = []  # torchtitan's RoPE of each layer, tables as long as the decode (reset)
        self.timed_sync = False  # CUDA: synchronise around waits, to time them (a separate pass)
        self.wait_s = 0.0
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    def reset(self, batch: int, max_len: int) -> None:
        """An empty KV cache and RoPE tables for ``max_len`` positions; zero the wait clock.

        A window layer's cache is a ring of its last ``min(window_size, max_len)`` positions (position ``p``
        in slot ``p % slots``): a query sees at most ``window_size - 1`` earlier positions, so its memory
        stays bounded at any length. A full layer keeps all ``max_len`` positions.

        The RoPE tables have ``max_len`` rows, past ``model.max_seq_len`` too: a row is the rotation by
        position times frequency, whatever the table's length (torchtitan's ``ComplexRoPE._precompute_cache``),
        so the rows below ``max_seq_len`` are the model's own and the rows beyond are the same RoPE,
        scaled or not, at further positions. ``max_seq_len`` only sizes the training model's tables.
        """
        with torch.device(self.device):
            self.ropes = [dataclasses.replace(self.cfg.rope_of(i), max_seq_len=max_len).build()
                          for i in range(self.cfg.n_layers)]

        def empty(length: int) -> torch.Tensor:
            return torch.zeros(batch, self.kv_heads, length, self.cfg.head_dim, device=self.device, dtype=self.dtype)

        lengths = [min(w, max_len) if (w := self.cfg.window_of(i)) else max_len for i in range(self.cfg.n_layers)]
        self.cache = [(empty(n), empty(n)) for n in lengths]
        self.wait_s = 0.0

    # The exchange. Time blocked on it counts as waiting; everything else is compute.
    def _sync(self) -> None:
        if self.timed_sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _reduce_now(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            self._sync()
            t0 = time.perf_counter()
            dist.all_reduce(t, group=self.group)
            self._sync()
            self.wait_s += time.perf_counter() - t0
        return t

    def _send(self, o: torch.Tensor) -> _Sent:
        total = o.sum(dim=2, keepdim=True)
        work = dist.all_reduce(total, group=self.group, async_op=True) if self.group is not None else None
        return _Sent(total, work, o)

    def _receive(self, sent: _Sent) -> torch.Tensor:
        """sum over the other lanes m != l of o_m, for each of this rank's lanes l."""
        if sent.work is not None:
            self._sync()
            t0 = time.perf_counter()
            sent.work.wait()
            self._sync()
            self.wait_s += time.perf_counter() - t0
        return sent.total - sent.own

    def _add(self, x, o, reduce: str, sends: bool, arrival: _Sent | None):
        """Laneformer's ``_add_partial``, with the lane sum split over ranks."""
        sent = None
        if reduce == "present":
            total = self._reduce_now(o.sum(dim=2, keepdim=True))
            x = x + total
            sent = _Sent(total, None, o) if sends else None
        else:
            sent = self._send(o) if sends else None
            x = x + (math.sqrt(self.L) * o if reduce == "scaled" else o)
        if arrival is not None:
            x = x + self._receive(arrival)
        return x, sent

    def _norm(self, x, name):
        return F.rms_norm(x, (self.cfg.dim,), self.w[name], self.cfg.norm_eps)

    def _cached(self, i: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """(keys, values, their positions) that layer ``i``'s queries at ``start``.. attend over; stores ``k, v``
        ``[B, kv_heads, S, head_dim]`` in the cache.

        A window layer's ring is read with the new keys before they are stored: a chunk longer than the
        ring overwrites positions its own first queries still see. Empty slots get negative positions.
        """
        k_cache, v_cache = self.cache[i]
        S, slots = k.shape[2], k_cache.shape[2]
        if self.cfg.window_of(i) is None:
            k_cache[:, :, start:start + S], v_cache[:, :, start:start + S] = k, v
            return k_cache[:, :, :start + S], v_cache[:, :, :start + S], torch.arange(start + S, device=self.device)
        held = start - 1 - (start - 1 - torch.arange(slots, device=self.device)) % slots  # latest position < start
        new = torch.arange(start, start + S, device=self.device)
        keys, values = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
        kept = new[-slots:] % slots  # the slots of the last positions, which the next queries may see
        k_cache[:, :, kept], v_cache[:, :, kept] = k[:, :, -slots:], v[:, :, -slots:]
        return keys, values, torch.cat([held, new])

    def _attention(self, i: int, x, start: int):
        B, S, n, _ = x.shape
        hd, p = self.cfg.head_dim, f"layers.{i}.attention."
        q = lane_linear(x, self.w[p + "wq.weight"]).reshape(B, S, self.heads, hd)
        k = lane_linear(x, self.w[p + "wk.weight"]).reshape(B, S, self.kv_heads, hd)
        v = lane_linear(x, self.w[p + "wv.weight"]).reshape(B, S, self.kv_heads, hd)
        positions = torch.arange(start, start + S, device=self.device).unsqueeze(0)
        q, k = self.ropes[i](q, k, positions)
        keys, values, k_pos = self._cached(i, k.transpose(1, 2), v.transpose(1, 2), start)
        q_pos, k_pos = positions[0].unsqueeze(1), k_pos.unsqueeze(0)
        mask = (k_pos >= 0) & (k_pos <= q_pos)
        window = self.cfg.window_of(i)
        if window:
            mask = mask & (q_pos - k_pos < window)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             scale=self.cfg.softmax_scale_of(i), enable_gqa=self.heads != self.kv_heads)
        return lane_linear(out.transpose(1, 2).reshape(B, S, n, -1), self.w[p + "wo.weight"])

    def _mlp(self, i: int, x):
        p = f"layers.{i}.feed_forward."
        return lane_linear(F.silu(lane_linear(x, self.w[p + "w1.weight"])) * lane_linear(x, self.w[p + "w3.weight"]),
                           self.w[p + "w2.weight"])

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Logits [B, V] (float32) of the last of ``tokens`` [B, S], which sit at positions start..start+S-1."""
        cfg = self.cfg
        h = F.embedding(tokens, self.w["tok_embeddings.weight"])
        x = h.unsqueeze(2).expand(-1, -1, len(self.lanes), -1)
        in_flight: dict[int, tuple[_Sent, _Sent]] = {}  # a layer's two sends, when it sends
        for i in range(cfg.n_layers):
            reduce, sends = cfg.exchange_of(i)
            arrival = in_flight.pop(i - cfg.delay, (None, None)) if cfg.delay else (None, None)
            o = self._attention(i, self._norm(x, f"layers.{i}.attention_norm.weight"), start)
            x, attn_sent = self._add(x, o, reduce, sends, arrival[0])
            o = self._mlp(i, self._norm(x, f"layers.{i}.ffn_norm.weight"))
            x, mlp_sent = self._add(x, o, reduce, sends, arrival[1])
            if attn_sent is not None:
                in_flight[i] = (attn_sent, mlp_sent)
        for attn_sent, mlp_sent in in_flight.values():  # only late_mode="flush" leaves sends in flight
            x = x + self._receive(attn_sent) + self._receive(mlp_sent)
        last = x[:, -1]  # [B, n, D]
        if cfg.final_agg == "mean_of_norms":
            h = self._reduce_now(self._norm(last, "norm.weight").sum(dim=1)) / self.L
        else:
            h = self._norm(self._reduce_now(last.sum(dim=1)), "norm.weight")
        return F.linear(h, self.w["lm_head.weight"]).float()


# --- decoding -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Decoded:
    ids: list[int]
    prefill_s: float
    step_s: list[float]  # one per decode step after the prefill
    wait_s: float  # time blocked on the exchange, prefill and steps

    @property
    def total_s(self) -> float:
        return self.prefill_s + sum(self.step_s)

    @property
    def per_token_s(self) -> float | None:
        return statistics.median(self.step_s) if self.step_s else None

    @property
    def wait_per_token_s(self) -> float:
        """Time blocked on the exchange per token (the prefill counts as one)."""
        return self.wait_s / (len(self.step_s) + 1)

    @property
    def compute_per_token_s(self) -> float:
        return (self.total_s - self.wait_s) / (len(self.step_s) + 1)


def greedy(decoder: LaneDecoder, prompt: list[int], max_new_tokens: int, eos_id: int | None = None) -> Decoded:
    """Greedy ids after ``prompt`` (stopping before ``eos_id`` unless it is None), with timings."""
    decoder.reset(1, len(prompt) + max_new_tokens)
    t0 = time.perf_counter()
    token = int(decoder.forward(torch.tensor([prompt], device=decoder.device), 0).argmax(-1))
    prefill, steps, ids = time.perf_counter() - t0, [], []
    while token != eos_id:
        ids.append(token)
        if len(ids) == max_new_tokens:
            break
        t0 = time.perf_counter()
        token = int(decoder.forward(torch.tensor([[token]], device=decoder.device), len(prompt) + len(ids) - 1)
                    .argmax(-1))
        steps.append(time.perf_counter() - t0)
    return Decoded(ids, prefill, steps, decoder.wait_s)


def timed(decoder: LaneDecoder, prompt: list[int], n_tokens: int) -> tuple[Decoded, Decoded]:
    """(latency pass, wait/compute pass) of ``n_tokens`` greedy tokens, EOS ignored.

    On CUDA the second pass synchronises around every wait, so the first
    pass's latency is undisturbed; on CPU waiting blocks the host anyway and
    one pass gives both.
    """
    run = greedy(decoder, prompt, n_tokens)
    if decoder.device.type != "cuda":
        return run, run
    decoder.timed_sync = True
    try:
        return run, greedy(decoder, prompt, n_tokens)
    finally:
        decoder.timed_sync = False


def timing_lines(label: str, runs: list[tuple[Decoded, Decoded]]) -> list[str]:
    """Latency of rank 0's run, and every rank's wait against compute."""
    latency, _ = runs[0]
    lines = [f"{label}: prefill {1e3 * latency.prefill_s:.1f} ms; per-token latency "
             + (f"{1e3 * latency.per_token_s:.2f} ms ({1 / latency.per_token_s:,.0f} tokens/s, median of "
                f"{len(latency.step_s)} steps)" if latency.per_token_s else "n/a (one token)")]
    for rank, (_, split) in enumerate(runs):
        lines.append(f"  rank {rank}: waiting on the exchange {1e3 * split.wait_per_token_s:.2f} ms/token, compute "
                     f"{1e3 * split.compute_per_token_s:.2f} ms/token "
                     f"({100 * split.wait_s / split.total_s:.0f}% waiting)")
    return lines


def gather(obj, group) -> list:
    """``obj`` of every rank of ``group``, in rank order (``[obj]`` without a group)."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def compare_with_tp(config, weights, lanes, device, dtype, group, prompt: list[int], n_tokens: int,
                    dtp: tuple[Decoded, Decoded]) -> tuple[list[str], float | None]:
    """Timing lines of the same decode with delay 0 (synchronous exchange per sub-block), and TP/DTP latency."""
    tp = LaneDecoder(dataclasses.replace(config, delay=0, delayed_exchange=True), weights, lanes, device, dtype, group)
    tp_runs = gather(timed(tp, prompt, n_tokens), group)
    ratio = None
    if tp_runs[0][0].per_token_s and dtp[0].per_token_s:
        ratio = tp_runs[0][0].per_token_s / dtp[0].per_token_s
    return timing_lines("standard TP (delay 0, a synchronous all-reduce per sub-block; a different model, "
                        "timing only)", tp_runs), ratio


# --- CLI ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> list[int]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="HF folder, run dir or DCP step dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--lane-parallel", action="store_true", help="under torchrun: this rank's lanes only")
    p.add_argument("--flavor", default=None, help="DCP checkpoints: the flavor (default: laneformer_config.json)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a model field")
    p.add_argument("--tokenizer", default=None, help="tokenizer.model or tokenizer folder (default: the checkpoint's "
                   "own: an export's or import's files, else the run's recipe.toml [data] tokenizer)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--no-tp-baseline", action="store_true", help="skip the delay-0 timing comparison")
    args = p.parse_args(argv)
    path, dtype = Path(args.checkpoint), getattr(torch, args.dtype)
    cuda = torch.cuda.is_available()
    group, own_group = None, False
    if args.lane_parallel:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if not dist.is_initialized():  # a caller may have started the group
            dist.init_process_group("nccl" if cuda else "gloo")
            own_group = True
        group = dist.group.WORLD
    rank, world = (dist.get_rank(), dist.get_world_size()) if group is not None else (0, 1)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    try:
        checkpoint = open_checkpoint(path)
        config = checkpoint.model_config(args.flavor, parse_overrides(args.set))
        lanes = lane_range(config.n_lanes, rank, world)
        # eval.run's rule: the checkpoint's own tokenizer, never a default
        from data.tokenizer import continuation_text

        tokenizer, notes = checkpoint.open_tokenizer(args.tokenizer, config.vocab_size)
        for note in notes if rank == 0 else ():
            print(note, file=sys.stderr)
        weights = checkpoint.load_weights(config, lanes)
        prompt = tokenizer.encode(args.prompt, bos=True)
        decoder = LaneDecoder(config, weights, lanes, device, dtype, group)
        out = greedy(decoder, prompt, args.max_new_tokens, tokenizer.eos_id)
        lines = []
        if group is not None and not args.no_tp_baseline and out.ids:
            dtp = timed(decoder, prompt, len(out.ids))
            lines = timing_lines(f"lane-parallel decode on {world} ranks ({config.n_lanes // world} lanes each, "
                                 f"delay {config.delay})", gather(dtp, group))
            tp_lines, ratio = compare_with_tp(config, weights, lanes, device, dtype, group, prompt, len(out.ids), dtp)
            lines += tp_lines
            lines.append(f"RATIO TP/DTP per-token latency: {ratio:.2f}x" if ratio else "RATIO n/a (one token)")
        else:
            lines = timing_lines("one process, every lane" if group is None else f"{world} ranks",
                                 gather((out, out), group))
        if rank == 0:
            print(continuation_text(tokenizer, prompt, out.ids))
            print("ids: " + " ".join(map(str, out.ids)))
            if device.type == "cpu" and group is not None:
                lines.append("(CPU and gloo: these timings check the mechanism only; measure on GPUs with NCCL)")
            print("\n".join(lines), flush=True)
        return out.ids
    finally:
        if own_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"generate: {e}", file=sys.stderr)
        sys.exit(2)
