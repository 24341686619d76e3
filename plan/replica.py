"""What the replica check (``health.consistency``) costs a step, for ``train.py --plan``.

The check sums each rank's 32-bit words of its shards of the fp32 parameters and both AdamW moments
(12 bytes a parameter over the ``shard`` ranks of a replica) and all-gathers 16 bytes a rank, every
``[training] consistency_every`` steps and before every save. It reads memory once and does no math
worth counting, so its time is the read at the GPU's memory bandwidth; the all-gather is
latency-bound and not estimated. A step that is both a periodic check and a save is checked once.
"""

from __future__ import annotations

import math


def plan_lines(nparams: int, replicate: int, shard: int, every: int, interval: int, dram_gbs: float,
               step_s: float) -> list[str]:
    """The check's cost per step: per check, and averaged over the steps (``every``: the periodic
    checks, 0 for none; ``interval``: the checkpoint interval; ``step_s``: the planned step)."""
    if replicate <= 1:
        return [f"replica check: cannot run: replicate = {replicate}, every shard is held by one rank (no copy "
                "to compare); HSDP ([parallel] replicate > 1) gives it"]
    read = 12 * nparams / shard
    check_s = read / (dram_gbs * 1e9)
    # distinct check steps: a save on a periodic check's step is checked once (ReplicaCheck.verified_step)
    per_step = check_s * ((1 / every + 1 / interval - 1 / math.lcm(every, interval)) if every else 1 / interval)
    when = f"every {every} steps and before each save" if every else "before each save"
    return [f"replica check ({replicate} replicas of {shard} shards): {read / 1e9:.2f} GB read per rank, "
            f"{check_s * 1e3:.2f} ms per check + one all-gather of 16 B per rank; {when} (checkpoint interval "
            f"{interval}): {per_step * 1e3:.3f} ms per step ({per_step / step_s:.4%} of the step)"]
