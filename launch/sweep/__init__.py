"""Ablation sweeps: a grid of recipe variants x seeds, each an ordinary run, started by the launchers.

    python -m launch.sweep SWEEP.toml [--dry-run [--gpus N --gpu h100]] [--nproc N] [--parallel K]
    python -m launch.sweep SWEEP.toml --slurm [--partition P --account A --time T --nodes N
                                              --gpus-per-node G --nproc-per-node R --slurm-arg=ARG ...]

The sweep file (``recipes/sweeps/*.toml``)::

    name = "dtp"                         # optional: the file's stem
    recipe = "phase1.toml"               # the base recipe
    seeds = [1, 2, 3]                    # run.seed of each repeat
    baseline = { "model.delay" = 0 }     # the variant every other is compared with
    metric = "eval/val_loss"             # optional: what the report compares on (report/comparable.py);
                                         # default eval/val_loss, eval/pref_accuracy for preference runs
    [set]                                # fixed overrides, the --set grammar (dotted or quoted keys)
    training.total_tokens = 2_000_000_000
    [vary]                               # axes: the grid is their product
    model.delay = [0, 1, 2]

``[[vary]]`` (several tables) makes the union of their grids, each at the base
values of the keys it does not vary: one axis at a time around a baseline
costs far less than the full product. Variants that come out equal are run once.

Each variant x seed is a run of train.py in ``runs/sweeps/<name>/<variant>-seed<k>/``
(``--root`` moves ``runs/sweeps/<name>``), started through ``launch.local`` (one
after another, or ``--parallel K`` at once) or ``launch.slurm submit`` (a job
per run); their requeue, resume and crash rules apply unchanged. A variant is
named by the values that differ from the baseline's (``delay=2,late_mode=flush``);
the baseline by its own (``delay=0``).

Before anything is written every variant passes train.py's preflight on the
launch's world size; an invalid one is refused naming the variant and the key
(exit 2, no sweep dir, no run dir). Running the command again starts only the
runs that are not done and not running, and prints done/running/left.
``sweep.json`` in the sweep dir records the grid, each run's dir and state;
``python -m report SWEEP_DIR`` compares the runs (report/sweep.py).
``--dry-run`` prints the grid and the runs' states; with ``--gpus N``, each
variant's memory plan and roofline tokens/s on N GPUs of kind ``--gpu``
(plan, as ``train.py --plan``) and the GPU-hours of every run and the sweep.

Exit status (``health.exits.Exit``): 0 when every run it started ended done (or a dry run's checks
passed); 2 (BAD_INPUT) for a bad flag, sweep file or variant, before anything is written; 1 (CRASH)
when a run's launcher gave up on it (launch.local exited non-zero: its ``fail`` decision, e.g. the
crash budget) or launch.slurm refused a submission. The sweep itself did not crash then, but a run of
it failed and a rerun is what it takes (it starts only those runs): 1, as launch.local's own exit for
a failed run.

Modules: ``spec`` reads the sweep file and makes and names its variants; ``runs`` lays out the runs,
reads their states, writes ``sweep.json`` and starts them; ``table`` prints the grid and the dry run's
plan; ``__main__`` is the command.
"""
