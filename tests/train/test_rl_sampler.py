"""The RL sampler (models.laneformer.sample): greedy at temperature 0, seeded per sample, and the per-token
log-probs the trainer's forward reproduces (the PPO ratio is 1 on-policy)."""

from __future__ import annotations

import torch

from models.laneformer.generate import LaneDecoder, greedy, random_weights
from models.laneformer.sample import next_tokens, sample, sample_seed
from tests.models.conftest import DECODE_PROMPT, decode_config, model_from_weights

NEW = 8


def decoder_and_weights():
    config = decode_config()
    weights = random_weights(config, range(config.n_lanes), seed=3)
    return LaneDecoder(config, weights, range(config.n_lanes), torch.device("cpu")), config, weights


def gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_temperature_zero_is_greedy():
    decoder, _, _ = decoder_and_weights()
    want = greedy(decoder, DECODE_PROMPT, NEW).ids
    for batch in (1, 3):
        out = sample(decoder, DECODE_PROMPT, gens(*range(batch)), NEW, None, temperature=0.0)
        assert [s.ids for s in out] == [want] * batch
    eos = want[3]  # greedy stops before EOS; the sampler keeps it (the policy learns to stop)
    assert sample(decoder, DECODE_PROMPT, gens(0), NEW, eos, temperature=0.0)[0].ids == \
        greedy(decoder, DECODE_PROMPT, NEW, eos).ids + [eos]


def test_each_sample_depends_on_its_own_seed_only():
    decoder, _, _ = decoder_and_weights()
    a, b, c = (sample_seed(7, 3, "task", i) for i in range(3))
    assert len({a, b, c}) == 3 and sample_seed(7, 3, "task", 0) == a
    together = sample(decoder, DECODE_PROMPT, gens(a, b, c), NEW, None)
    alone = sample(decoder, DECODE_PROMPT, gens(b), NEW, None)
    assert together[1].ids == alone[0].ids  # log-probs to rounding: a batch of 3 sums in another order than 1
    torch.testing.assert_close(torch.tensor(together[1].logprobs), torch.tensor(alone[0].logprobs))
    again = sample(decoder, DECODE_PROMPT, gens(a, b, c), NEW, None)  # a resume samples the same, bit for bit
    assert [(s.ids, s.logprobs) for s in again] == [(s.ids, s.logprobs) for s in together]
    assert len({tuple(s.ids) for s in together}) > 1  # sampled, not greedy
    assert all(s.truncated for s in together)


def test_logprobs_are_the_models_own():
    decoder, config, weights = decoder_and_weights()
    s = sample(decoder, DECODE_PROMPT, gens(11), NEW, None)[0]
    with torch.no_grad():
        logits = model_from_weights(config, weights)(torch.tensor([DECODE_PROMPT + s.ids]))[0]
    logp = torch.log_softmax(logits.float(), -1)[len(DECODE_PROMPT) - 1:-1].gather(1, torch.tensor(s.ids)[:, None])
    torch.testing.assert_close(torch.tensor(s.logprobs), logp[:, 0], rtol=1e-4, atol=1e-4)


def test_top_k_and_top_p_keep_only_their_tokens():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]])
    for _ in range(20):
        assert int(next_tokens(logits, 1.0, 2, 1.0, gens(_))[0]) in (0, 1)
        assert int(next_tokens(logits, 1.0, 0, 0.5, gens(_))[0]) == 0
