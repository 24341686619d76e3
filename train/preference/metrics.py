"""The metrics of a preference run, named once (torch-free: the run report reads them).

At every logging step (train.objectives.preference), means over the step's pairs; at the eval's steps, on
the held-out pairs (train.callbacks.eval).
"""

LOSS = "pref/loss"
LOGPS_CHOSEN = "pref/logps_chosen"
LOGPS_REJECTED = "pref/logps_rejected"
REWARDS_CHOSEN = "pref/rewards_chosen"
REWARDS_REJECTED = "pref/rewards_rejected"
REWARDS_ACCURACY = "pref/rewards_accuracy"
REWARDS_MARGIN = "pref/rewards_margin"
STEP_METRICS = (LOSS, LOGPS_CHOSEN, LOGPS_REJECTED, REWARDS_CHOSEN, REWARDS_REJECTED, REWARDS_ACCURACY,
                REWARDS_MARGIN)
EVAL_LOSS = "eval/pref_loss"
EVAL_ACCURACY = "eval/pref_accuracy"
