"""Launching runs: on SLURM (launch.slurm) or one machine (launch.local), both
restarting from the latest checkpoint after preemption or a crash (launch.attempts)."""
