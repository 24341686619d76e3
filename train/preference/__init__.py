"""Preference optimization after SFT (DPO, length-normalized DPO, SimPO): the run's ``[preference]``.

- ``loss``: the objectives and per-sequence log-probs (log-softmax in fp32);
- ``reference``: the reference log-probs of the ``init_from`` weights, computed once before step 1 by
  the policy itself (no second model), kept in the run dir under a key of what they depend on;
- ``metrics``: the names of a preference run's metrics;
- ``plan``: what a preference run reads and costs, from the recipe alone (``--dry-run``).

The run's loss itself, its batches' pair ids, its reference pass before step 1 and its ``pref/*``
metrics are its objective's (train.objectives.preference); whether a run is one is ``Recipe.objective``.

The pairs themselves are data: their format and the check of a pair source in data.pairs, their
batches and torchtitan loader in data.pairs_loader.

Designed after open-instruct (``open_instruct/dpo_utils.py``: ``build_reference_logprobs_cache``,
``dpo_loss``, ``simpo_loss``, ``concatenated_forward``), TRL's ``DPOTrainer`` and torchtune's
``DPOLoss`` (``torchtune/rlhf/loss/dpo.py``).
"""
