"""Preference optimization after SFT (DPO, length-normalized DPO, SimPO): the run's ``[preference]``.

- ``loss``: the objectives and per-sequence log-probs (log-softmax in fp32);
- ``pairs``: pair sources (chosen and rejected documents adjacent in a tokenized source) read as
  batches of ``[chosen..., rejected...]`` rows with their pair ids, deterministic and resumable;
- ``reference``: the reference log-probs of the ``init_from`` weights, computed once before step 1 by
  the policy itself (no second model), kept in the run dir under a key of what they depend on;
- ``trainer``: the trainer whose loss is the preference loss, with its ``pref/*`` metrics.

Designed after open-instruct (``open_instruct/dpo_utils.py``: ``build_reference_logprobs_cache``,
``dpo_loss``, ``simpo_loss``, ``concatenated_forward``), TRL's ``DPOTrainer`` and torchtune's
``DPOLoss`` (``torchtune/rlhf/loss/dpo.py``).
"""
