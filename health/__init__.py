"""The run's health: what keeps a long run alive and honest, apart from the step itself.

- ``phases``: the one enum of a rank's phases, with each one's stall allowance and goodput bucket;
- ``heartbeat``: each rank's beat (its step and phase) for the watchdog and goodput;
- ``holder``: one live writer per run dir;
- ``guard``: skip a spiking step on the device; ``rollback``: roll back spikes that keep coming;
- ``consistency``: HSDP replicas compared bit for bit; ``straggler``: name the slow rank;
- ``preemption``: a signal becomes a checkpoint at a step boundary;
- ``storage``: disk space for checkpoints; ``alerts``: the one writer of alerts for people;
- ``goodput``: productive time over wall time, and what each cause cost.

Torch-free where a launcher reads them (phases, heartbeat, holder, alerts, storage, goodput).
The callbacks that call these at points of a step are in ``train.callbacks``.
"""
