"""Side effects of training, one callback a file, called by ``LaneformerTrainer`` at named points.

``callback``: the base (points, name, priority, phase, state) and the dispatcher. The callbacks,
by the point where they act (``train.build.callbacks`` makes the run's list from its recipe):

- ``heartbeat``: a step's number and its count of done steps, for the watchdog and goodput;
- ``spike_guard``: skip a spiking step on the device; stop after too many (``SkippedOut``);
- ``bitflip`` (tests only) and ``replica_check``: HSDP replicas compared bit for bit;
- ``progress``, ``source_tokens``, ``metrics_file``: what a logging step prints and records;
- ``straggler``: name the slow rank;
- ``eval``, ``report``, ``export``: in-loop evaluation, the run report, the end-of-run HF export;
- ``preemption``: a signal becomes a checkpoint and an exit at a step boundary;
- ``rollback``: spikes that keep coming are rolled back to a checkpoint before them.

What they call into lives in ``health`` (the run's health) and ``eval``.
"""
