"""An RL run's tasks (``[rl] tasks``, train.objectives.rl): a JSONL of ``{"id", "prompt", "tests"}``, split into
training and held-out tasks by data.held_out's rule, and the data loader slot that hands each rank its share
of a step's prompts.

A task's ``prompt`` is the text the policy continues (a function's signature and docstring); ``tests`` is a list
of Python statements (``assert f(1) == 2``), each scored on its own (eval.rewards). The held-out split is the
rule every other source is split by (data.held_out): a task is held out when the key of its prompt's ids under
the run's tokenizer (BOS included, as the sampler sees it) is below ``floor(fraction x 2**64)``.

Order: epoch e visits every training task once, in a permutation seeded by (seed, e), as the pair loader
(data.pairs_loader) does. A micro batch holds ``local_batch_size / G`` prompts (G samples each, drawn by the
objective before the forward). The loader's state is the next global prompt index: a resume reads on from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan.components.dataloader import BaseDataLoader

from data.held_out import document_key, threshold
from data.loader import SentencePieceTokenizer

PROMPT_INDEX = "prompt_index"  # a micro batch's task indices (into the training tasks), before sampling


class TaskError(ValueError):
    """A task file that cannot be used (names the file and line)."""


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    tests: tuple[str, ...]
    ids: tuple[int, ...]  # the prompt's ids, BOS first


def read_tasks(path: str | Path, tokenizer) -> list[Task]:
    """Every task of ``path``, in file order, its prompt tokenized with ``tokenizer`` (data.tokenizer.Tokenizer)."""
    out, seen = [], set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            task = Task(str(row["id"]), str(row["prompt"]), tuple(str(t) for t in row["tests"]),
                        tuple(tokenizer.encode(str(row["prompt"]), bos=True)))
        except (ValueError, KeyError, TypeError) as e:
            raise TaskError(f"{path}:{n}: expected {{\"id\", \"prompt\", \"tests\": [...]}} ({type(e).__name__}: {e})"
                            ) from None
        if not task.tests or task.id in seen:
            raise TaskError(f"{path}:{n}: task {task.id!r} " + ("has no tests" if not task.tests else "repeats an id"))
        seen.add(task.id)
        out.append(task)
    if not out:
        raise TaskError(f"{path}: no tasks")
    return out


def split(tasks: list[Task], held_out: float) -> tuple[list[Task], list[Task]]:
    """(training, held-out) tasks by data.held_out's rule on each prompt's ids."""
    limit = threshold(held_out, [])
    kept = [t for t in tasks if document_key(np.asarray(t.ids)) >= limit]
    return kept, [t for t in tasks if document_key(np.asarray(t.ids)) < limit]


class TaskLoader:
    """One data-parallel rank's micro batches of prompt indices (the module's docstring says the order)."""

    def __init__(self, n_tasks: int, prompts: int, seed: int, rank: int = 0, world_size: int = 1):
        self.n, self.prompts, self.seed, self.rank, self.world_size = n_tasks, prompts, seed, rank, world_size
        self.next_index = 0  # the next global prompt index

    def indices(self, first: int, count: int) -> np.ndarray:
        out = []
        for i in range(first, first + count):
            order = np.random.default_rng([self.seed, i // self.n]).permutation(self.n)
            out.append(int(order[i % self.n]))
        return np.array(out, dtype=np.int64)

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        ids = self.indices(self.next_index + self.rank * self.prompts, self.prompts)
        self.next_index += self.prompts * self.world_size
        return ids

    def state_dict(self) -> dict[str, Any]:
        return {"next_index": self.next_index, "seed": self.seed, "tasks": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed or state["tasks"] != self.n:
            raise TaskError(f"checkpoint was written for {state['tasks']} tasks with seed {state['seed']}; this run "
                            f"has {self.n} with seed {self.seed}")
        self.next_index = int(state["next_index"])


class TaskDataLoader(BaseDataLoader):
    """torchtitan's data loader slot for an RL run: ``({PROMPT_INDEX: [k]}, labels)``, k = micro batch / G; the
    labels are a placeholder of the micro batch's training shape (torchtitan counts their tokens), replaced with
    the sampled sequences by the objective (``Objective.make_batches``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        tasks: str = ""
        held_out: float = 0.2
        samples_per_prompt: int = 1
        seed: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: SentencePieceTokenizer,
                 seq_len: int, local_batch_size: int, **kwargs: Any):
        self.train, self.held_out = split(read_tasks(config.tasks, tokenizer.tokenizer), config.held_out)
        if not self.train:
            raise TaskError(f"{config.tasks}: every task is held out at held_out {config.held_out}")
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.loader = TaskLoader(len(self.train), local_batch_size // config.samples_per_prompt, config.seed,
                                 dp_rank, dp_world_size)

    def __iter__(self):
        for ids in self.loader:
            yield {PROMPT_INDEX: torch.from_numpy(ids)}, torch.zeros(self.local_batch_size, self.seq_len,
                                                                     dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.loader.load_state_dict(state_dict)
