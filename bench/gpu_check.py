"""One GPU acceptance run: every GPU fact the CPU cannot give, in one command.

    .venv/bin/python -m bench.gpu_check [--out gpu_check.json]   # one H100/H200, < 8 min
    .venv/bin/python -m bench.gpu_check --cpu-check              # the same code path, tiny, CPU fp32

Five checks, a table, and ``gpu_check.json``:

1. attention: FlexAttention (torchtitan's kernel, as the model runs it) against
   the dense-mask reference (``DenseMaskFlexAttention``: SDPA over the
   BlockMask's own ``mask_mod``), forward and backward, for the 2B's masks
   (window 2048 and full causal, packed documents). Tolerance: the flex error
   against the fp32 reference must be within 2x (+1e-3) of the error that the
   reference itself makes in bf16, per output and per gradient (relative to
   the largest reference value).
2. training: tiny and 100M, blocks compiled, bf16 autocast, 50 AdamW steps on
   one fixed batch: the loss falls (mean of the last 5 below the first 5), and
   no graph is compiled after the warm-up steps (dynamo's unique-graph count).
3. 2B: one GPU at the planner's recommended setting (``train.py --plan
   --sweep --json``; the recipe's micro batch and AC when no recommendation is
   printed, said in the output): tokens/s, MFU and measured peak memory
   (``torch.cuda.max_memory_allocated``, through ``bench.gpu_throughput``'s
   production path), beside the planner's ``peak memory per GPU`` as a ratio.
   The planner runs in subprocesses on the CPU while the GPU works.
4. ``bench.lanes_vs_dense`` at the 100M shape, compiled (its ratio).
5. context parallelism: one training step of the tiny flavor with CP 2 (flex, NCCL, 2 GPUs) equals
   CP 1: logits, gradients and the logits after one AdamW step, with window and document masks
   cut by the slices (``tests/models/context_parallel_ranks.py``, which the CPU test runs with gloo).
   It needs 2 GPUs (NCCL takes one rank a GPU): on one it is reported as skipped.

On a machine without a GPU it says that nothing was checked and exits 1. ``--cpu-check`` runs
every check on the tiny flavor on CPU in fp32 at small sizes, to test the
script: flex has no CPU backward, so check 1 runs forward only, and check 3
trains eagerly through ``bench.common`` (``bench.gpu_throughput`` is GPU only)
beside the planner's real output for the tiny recipe; check 5 runs on 2 gloo ranks
with the dense-mask kernel. Its numbers mean nothing. Exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import common, gpu_throughput, lanes_vs_dense
from models.laneformer import laneformer_configs
from rundir import REPO
from plan.gpus import gpu_for_device

CONTEXT_PARALLEL_RANKS = REPO / "tests" / "models" / "context_parallel_ranks.py"


@dataclasses.dataclass
class Sizes:
    """What each check runs at: the real shapes on GPU, toy ones for --cpu-check."""

    mask_flavor: str  # whose attention masks check 1 uses
    attn_batch: int
    attn_seq: int
    train_flavors: tuple[str, ...]
    train_seq: int
    train_batch: int
    train_steps: int
    warmup: int
    big_flavor: str  # check 3
    big_seq: int
    recipe: str
    lanes_flavor: str  # check 4
    lanes_seq: int
    lanes_batch: int
    lanes_steps: int


GPU = Sizes("2B", 2, 4096, ("tiny", "100M"), 1024, 8, 50, 3, "2B", 4096, "phase1.toml", "100M", 2048, 4, 10)
CPU = Sizes("tiny", 1, 128, ("tiny",), 64, 2, 10, 2, "tiny", 64, "tiny.toml", "tiny", 64, 1, 2)


def _dense_attention():
    from models.laneformer.attention import DenseMaskFlexAttention

    return DenseMaskFlexAttention.Config().build()


def packed_positions(batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """Positions restarting at 0 at each packed document (3-5 documents of random length per row)."""
    rows = []
    for _ in range(batch):
        n_docs = int(torch.randint(3, 6, (1,), generator=gen))
        cuts = sorted(torch.randperm(seq - 1, generator=gen)[: n_docs - 1].add(1).tolist())
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, seq])]
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(rows)


def _attend(attn, q, k, v, mask, dtype, grad_out):
    """(output, dq, dk, dv) of ``attn`` on inputs cast to ``dtype`` (grads None when grad_out is None)."""
    leaves = [t.detach().to(dtype).requires_grad_(grad_out is not None) for t in (q, k, v)]
    out = attn(*leaves, attention_masks=mask, enable_gqa=q.shape[2] != k.shape[2])
    if grad_out is None:
        return [out.detach().float(), None, None, None]
    out.backward(grad_out.to(dtype))
    return [out.detach().float(), *(t.grad.float() for t in leaves)]


def check_attention(sizes: Sizes, dev: torch.device) -> list[dict]:
    """Check 1: flex vs dense-mask SDPA, per distinct window of the flavor's layers."""
    from torchtitan.models.common.attention import FlexAttention

    config = laneformer_configs[sizes.mask_flavor]()
    with torch.device("meta"):
        model = config.build()  # only its attention_masks(): the masks the model itself builds
    gen = torch.Generator().manual_seed(0)
    B, S, H, KV, hd = sizes.attn_batch, sizes.attn_seq, config.n_heads, config.n_kv_heads, config.head_dim
    positions = packed_positions(B, S, gen).to(dev)
    tokens = torch.zeros(B, S, dtype=torch.long, device=dev)
    q, k, v = (torch.randn(B, S, n, hd, generator=gen).to(dev) for n in (H, KV, KV))
    backward = dev.type == "cuda"  # flex has no CPU backward
    grad_out = torch.randn(B, S, H, hd, generator=gen).to(dev) if backward else None
    low = torch.bfloat16 if dev.type == "cuda" else torch.float32
    flex, dense = FlexAttention.Config().build(), _dense_attention()
    rows = []
    for window, mask in model.attention_masks(tokens, positions).items():
        ref = _attend(dense, q, k, v, mask, torch.float32, grad_out)
        base = _attend(dense, q, k, v, mask, low, grad_out)
        got = _attend(flex, q, k, v, mask, low, grad_out)
        for name, r, b, g in zip(("out", "dq", "dk", "dv"), ref, base, got):
            if r is None:
                continue
            scale = r.abs().max().clamp_min(1e-12)
            err, base_err = float((g - r).abs().max() / scale), float((b - r).abs().max() / scale)
            rows.append({"mask": f"window {window}" if window else "full causal", "tensor": name,
                         "flex_err": err, "sdpa_err": base_err, "ok": err <= 2 * base_err + 1e-3})
    return rows


def check_training(flavor: str, sizes: Sizes, dev: torch.device) -> dict:
    """Check 2: compiled blocks, bf16 autocast on GPU, one fixed batch; the loss falls, no recompiles."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    config = common.laneformer_config(flavor)
    model = common.compile_blocks(common.build(config, dev))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=dev.type == "cuda")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (sizes.train_batch, sizes.train_seq + 1), generator=gen).to(dev)
    step = common.train_step_fn(model, opt, common.lane_forward, tokens[:, :-1], tokens[:, 1:],
                                autocast=dev.type == "cuda")
    t0 = time.perf_counter()
    losses = [step() for _ in range(sizes.warmup)]
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    losses += [step() for _ in range(sizes.train_steps - sizes.warmup)]
    recompiles = counters["stats"]["unique_graphs"] - graphs_after_warmup
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    return {"flavor": flavor, "steps": len(losses), "loss_first5": first, "loss_last5": last,
            "graphs_after_warmup": recompiles, "seconds": time.perf_counter() - t0,
            "ok": last < first and recompiles == 0}


class Planner:
    """``train.py --recipe R --plan --json --gpus 1 --gpu G [--set ...]`` running in the background."""

    def __init__(self, recipe: str, gpu: str, *sets: str):
        args = [a for s in sets for a in (["--sweep"] if s == "--sweep" else ["--set", s])]
        # One GPU: the recipe's data-parallel layout (e.g. shard 8 inside a node) does not apply.
        self.cmd = [sys.executable, str(REPO / "train.py"), "--recipe", recipe, "--plan", "--json", "--gpus", "1",
                    "--gpu", gpu, "--set", "parallel.shard=1", "--set", "parallel.replicate=1", *args]
        # Files, not pipes: nothing blocks while we do not read.
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=self.out, stderr=self.err, text=True)

    def result(self, timeout: float) -> tuple[dict | None, str]:
        """(the plan's JSON, or None; the tail of its stderr and why there is no JSON)."""
        try:
            self.proc.wait(timeout=timeout)
            note = ""
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            note = f"\n(planner killed after waiting {timeout:.0f} s more)"
        self.out.seek(0)
        self.err.seek(0)
        tail = self.err.read()[-2000:] + note
        try:
            return json.loads(self.out.read()), tail
        except json.JSONDecodeError as e:
            return None, f"{tail}\n(no JSON on stdout: {e})"


def _recipe_setting(recipe: str) -> tuple[int, str]:
    """The recipe's own micro batch and AC (train.recipe's schema and defaults)."""
    from train.recipe import load

    loaded = load(recipe)
    return loaded.training.micro_batch, loaded.parallel.activation_checkpoint


def _cpu_stand_in(sizes: Sizes, micro_batch: int) -> dict:
    """--cpu-check's measurement for check 3: bench.gpu_throughput is GPU only (FSDP2, bf16, CUDA memory
    stats), so on CPU the flavor trains eagerly through bench.common, to check the rest of the path."""
    config = common.laneformer_config(sizes.big_flavor)
    model = common.build(config, torch.device("cpu"))
    tokens = torch.randint(0, config.vocab_size, (micro_batch, sizes.big_seq + 1))
    step = common.train_step_fn(model, torch.optim.AdamW(model.parameters()), common.lane_forward,
                                tokens[:, :-1], tokens[:, 1:], autocast=False)
    seconds = common.time_interleaved({"step": step}, warmup=1, steps=2)["step"]
    return {"tps": micro_batch * sizes.big_seq / common.fastest(seconds), "mfu": None}


def _sweep_row(swept: dict | None, micro_batch: int, ac: str) -> dict | None:
    """The sweep's traced row for (micro batch, AC), if it has one with a peak."""
    for row in (swept or {}).get("sweep", []):
        if row["micro_batch"] == micro_batch and row["ac"] == ac and row["peak_gib"] is not None:
            return row
    return None


def check_big(sizes: Sizes, gpu: str, sweep: Planner, cpu: bool) -> dict:
    """Check 3: the recommended setting measured, beside the planner's peak-memory prediction for it."""
    swept, _ = sweep.result(timeout=420)
    rec = swept and swept["recommended"]
    if rec:
        (mb, ac), source = (rec["micro_batch"], rec["ac"]), "planner --sweep recommendation"
    else:
        (mb, ac), source = _recipe_setting(sizes.recipe), f"{sizes.recipe} (the planner printed no recommendation)"
    # The sweep traced this setting's memory already; plan it apart only when the sweep has no row for it.
    swept_row = _sweep_row(swept, mb, ac)
    plan = None if swept_row else Planner(sizes.recipe, gpu, f"training.micro_batch={mb}",
                                          f"parallel.activation_checkpoint={ac}", f"training.seq_len={sizes.big_seq}")
    if cpu:
        row = _cpu_stand_in(sizes, mb)
        held = None
    else:
        torch._dynamo.reset()  # drop the earlier checks' compiled graphs and the models they hold
        gc.collect()
        held = torch.cuda.memory_allocated() / 2**30
        rows = gpu_throughput.main(["--flavors", sizes.big_flavor, "--seq", str(sizes.big_seq), "--ac", ac,
                                    "--micro-batches", str(mb), "--warmup", "3", "--steps", "10"])
        row = rows[0] if rows else {}
    if plan is None:
        predicted, plan_tail = {"peak_gib": swept_row["peak_gib"], "fits": swept_row["fits"]}, ""
    else:
        planned, plan_tail = plan.result(timeout=420)
        predicted = planned and planned["memory"]
    measured = float(row["peak GiB"]) if "tps" in row and not cpu else None
    out = {"setting_source": source, "micro_batch": mb, "ac": ac, "seq": sizes.big_seq,
           "tokens_per_s": row.get("tps"), "mfu": row.get("mfu"), "measured_peak_gib": measured,
           "predicted_peak_gib": predicted and predicted["peak_gib"], "planner_says_fits": predicted and predicted["fits"],
           "measured_over_predicted": measured / predicted["peak_gib"] if measured and predicted else None,
           "error": row.get("tokens/s/GPU") if "tps" not in row else None, "gib_held_before": held}
    if predicted is None:
        out["planner_output_tail"] = plan_tail
    out["ok"] = "tps" in row and predicted is not None
    return out


def check_lanes_vs_dense(sizes: Sizes, cpu: bool) -> dict:
    """Check 4: bench.lanes_vs_dense at the 100M shape, compiled (the target is judged on GPU only)."""
    torch._dynamo.reset()
    row = lanes_vs_dense.measure(sizes.lanes_flavor, sizes.lanes_seq, sizes.lanes_batch, ["compiled"],
                                 warmup=3, steps=sizes.lanes_steps)[0]
    ratio = row["ratio_value"]
    return {"flavor": sizes.lanes_flavor, "seq": sizes.lanes_seq, "batch": sizes.lanes_batch,
            "lanes_s_per_step": float(row["lanes s/step"]), "dense_s_per_step": float(row["dense s/step"]),
            "ratio": ratio, "target": lanes_vs_dense.TARGET, "ok": cpu or ratio <= lanes_vs_dense.TARGET}


def check_context_parallel(cpu: bool) -> dict:
    """Check 5: CP 2 equals CP 1 on the tiny flavor, by the CPU test's own 2-rank script."""
    gpus = torch.cuda.device_count()
    if not cpu and gpus < 2:
        return {"result": f"skipped: needs 2 GPUs, found {gpus}", "ok": None}
    run = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
                          str(CONTEXT_PARALLEL_RANKS)], cwd=REPO, capture_output=True, text=True, timeout=600)
    ok = run.returncode == 0 and "CP OK" in run.stdout
    return {"result": "equal: logits, gradients, one step" if ok else (run.stdout + run.stderr)[-3000:], "ok": ok}


def gpu_kind(device_name: str) -> str:
    """The planner's --gpu name for a CUDA device name (h100 when unknown)."""
    return gpu_for_device(device_name) or "h100"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check.json", help="where to write the JSON report")
    p.add_argument("--cpu-check", action="store_true", help="run the code path on CPU (tiny, fp32, toy sizes)")
    p.add_argument("--checks", default="1,2,3,4,5",
                   help="which checks to run (1 attention, 2 training, 3 2B, 4 lanes, 5 context parallel)")
    args = p.parse_args(argv)
    cpu = args.cpu_check
    if not cpu and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA GPU found, so nothing was checked. This is the GPU acceptance script: "
              "run it on one H100 or H200 (or pass --cpu-check to exercise its code path on CPU).", file=sys.stderr)
        return 1  # the machine, not the input (README: 2 bad input, 1 the environment)
    sizes, dev = (CPU, torch.device("cpu")) if cpu else (GPU, torch.device("cuda"))
    name = "cpu (code-path check only)" if cpu else torch.cuda.get_device_name()
    gpu = gpu_kind("" if cpu else name)
    t0 = time.perf_counter()
    # The planner traces on fake CPU tensors: start it now, it runs while the GPU works.
    sweep = Planner(sizes.recipe, gpu, "--sweep", f"training.seq_len={sizes.big_seq}") if "3" in args.checks else None
    report: dict = {"device": name, "cpu_check": cpu, "torch": torch.__version__, "seconds_per_check": {}}
    checks = {  # number -> (key, check); 3 runs last, so the background planner gets the most time
        "1": ("attention", lambda: check_attention(sizes, dev)),
        "2": ("training", lambda: [check_training(f, sizes, dev) for f in sizes.train_flavors]),
        "4": ("lanes_vs_dense", lambda: check_lanes_vs_dense(sizes, cpu)),
        "5": ("context_parallel", lambda: check_context_parallel(cpu)),
        "3": ("big", lambda: check_big(sizes, gpu, sweep, cpu)),
    }
    for number, (key, check) in checks.items():
        if number in args.checks.split(","):
            start = time.perf_counter()
            report[key] = check()
            report["seconds_per_check"][key] = time.perf_counter() - start
    report["seconds"] = time.perf_counter() - t0
    results = [*report.get("attention", []), *report.get("training", []), report.get("lanes_vs_dense"),
               report.get("big"), report.get("context_parallel")]
    report["ok"] = all(r["ok"] for r in results if r is not None and r["ok"] is not None)  # None: skipped
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report))
    print(f"wrote {args.out}; {'PASS' if report['ok'] else 'FAIL'} in {report['seconds']:.0f} s")
    return 0 if report["ok"] else 1


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def summary(report: dict) -> str:
    """One table: a row per check."""
    rows = [{"check": f"1 attention {r['mask']} {r['tensor']}",
             "result": f"flex err {r['flex_err']:.2e}, SDPA in the same dtype {r['sdpa_err']:.2e}", "ok": r["ok"]}
            for r in report.get("attention", [])]
    rows += [{"check": f"2 train {r['flavor']} x{r['steps']}",
              "result": f"loss {r['loss_first5']:.3f} -> {r['loss_last5']:.3f}, "
                        f"{r['graphs_after_warmup']} graphs after warm-up", "ok": r["ok"]}
             for r in report.get("training", [])]
    b = report.get("big")
    if b:
        mfu = "n/a" if b["mfu"] is None else f"{100 * b['mfu']:.1f}%"
        rows.append({"check": f"3 {b['micro_batch']}x{b['seq']} ac={b['ac']}",
                     "result": (f"{_fmt(b['tokens_per_s'], ',.0f')} tok/s, MFU {mfu}, peak "
                                f"{_fmt(b['measured_peak_gib'], '.1f')} GiB / planned "
                                f"{_fmt(b['predicted_peak_gib'], '.1f')} GiB = {_fmt(b['measured_over_predicted'], '.2f')}"
                                + (f" ({b['error']})" if b["error"] else "")),
                     "ok": b["ok"]})
        rows.append({"check": "  setting from", "result": b["setting_source"], "ok": ""})
    lv = report.get("lanes_vs_dense")
    if lv:
        rows.append({"check": f"4 lanes/dense {lv['flavor']} compiled",
                     "result": f"{lv['ratio']:.2f}x (target <= {lv['target']}x)", "ok": lv["ok"]})
    cp = report.get("context_parallel")
    if cp:
        rows.append({"check": "5 context parallel 2 vs 1", "result": cp["result"].strip().splitlines()[-1],
                     "ok": "skipped" if cp["ok"] is None else cp["ok"]})
    return f"gpu_check on {report['device']}\n" + common.table(rows, ["check", "result", "ok"])


if __name__ == "__main__":
    sys.exit(main())
