"""Generation past the base model's length (issue 44 item 7): the KV-cache decoder and the HF export's
``generate`` give the ids, and the logits, of greedy decoding by repeated full forward passes of
``Laneformer.forward`` (no cache: the independent reference); the lane-parallel decoder is checked
against the same reference in tests/e2e/test_lane_parallel_decode.py (``long/8``).

"The base model's length" is what its RoPE was made for: ``max_seq_len`` for a model without RoPE
scaling, ``rope_original_seq_len`` for a scaled one (extended to ``rope_scaling_factor`` times that,
with ``max_seq_len`` raised to match, as recipes/tiny-long.toml does). Both cases below have a base
length of 64 and a 256-token prompt (4x), and decode past ``max_seq_len``: the decoder sizes its RoPE
tables to the decode, not to ``max_seq_len`` (``LaneDecoder.reset``). A window of 16 binds on layers 0-1.
"""

import dataclasses

import pytest
import torch

from models.laneformer import laneformer_configs
from models.laneformer.attention import attention_config
from models.laneformer.generate import LaneDecoder, greedy, random_weights
from tests.models.conftest import model_from_weights
from tests.models.test_generate import stepwise_logits

BASE = 64  # the base model's length in both cases
WINDOW = 16
NEW = 8
CASES = {
    "no scaling, 4x max_seq_len": {"max_seq_len": BASE},
    "yarn x4, 4x the original length": {"max_seq_len": 4 * BASE, "rope_scaling": "yarn", "rope_scaling_factor": 4.0,
                                        "rope_original_seq_len": BASE},
}
PROMPT = torch.randint(3, 4096, (4 * BASE,), generator=torch.Generator().manual_seed(44)).tolist()


def long_config(case: str):
    """The tiny flavor (4 layers, window layers 0-1, 8 lanes, delay 2) with a window of 16 and ``CASES[case]``."""
    return dataclasses.replace(laneformer_configs["tiny"](), window_size=WINDOW,
                               inner_attention=attention_config("dense"), **CASES[case])


def long_weights(config, lanes: range | None = None):
    """The random model of these tests, or its ``lanes`` (any split gives the same model: ``random_weights``)."""
    return random_weights(config, lanes or range(config.n_lanes), seed=7)


def reference_greedy(config, weights, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """(ids, next-token logits [n, V]) of greedy decoding by a full forward of the whole sequence per token.

    The model is built with ``max_seq_len`` covering the decode: that field sizes only its RoPE tables
    (``test_max_seq_len_only_sizes_the_rope_tables``), and the training model refuses positions past them.
    """
    model = model_from_weights(dataclasses.replace(config, max_seq_len=len(prompt) + n), weights)
    seq, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits.append(model(torch.tensor([seq]))[0, -1])
            seq.append(int(logits[-1].argmax()))
    return seq[len(prompt):], torch.stack(logits)


@pytest.fixture(scope="module")
def references() -> dict:
    """case -> (config, weights, reference ids, reference logits)."""
    out = {}
    for case in CASES:
        config = long_config(case)
        weights = long_weights(config)
        out[case] = (config, weights, *reference_greedy(config, weights, PROMPT, NEW))
    return out


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_decoder_equals_full_forwards_past_the_base_length(references, case):
    config, weights, ids, logits = references[case]
    assert len(PROMPT) == 4 * BASE and len(PROMPT) + NEW > config.max_seq_len
    decoder = LaneDecoder(config, weights, range(config.n_lanes), torch.device("cpu"))
    assert greedy(decoder, PROMPT, NEW).ids == ids
    torch.testing.assert_close(stepwise_logits(decoder, ids, PROMPT), logits, rtol=1e-4, atol=1e-4)
    assert len(set(ids)) > 1  # not one token repeated: the equality says something


def test_the_cases_are_different_models(references):
    """The yarn case changes the logits (its full layers), so both cases test something of their own."""
    (*_, a), (*_, b) = references.values()
    assert (a - b).abs().max() > 1e-2


@pytest.mark.parametrize("case", CASES)
def test_window_layers_cache_only_their_window(references, case):
    """After decoding past 4x the base length a window layer holds WINDOW positions, a full layer all of them:
    the window layers' memory does not grow with the length."""
    config, weights, *_ = references[case]
    decoder = LaneDecoder(config, weights, range(config.n_lanes), torch.device("cpu"))
    for length in (WINDOW // 2, len(PROMPT) + NEW):
        decoder.reset(1, length)
        for layer, (k, v) in enumerate(decoder.cache):
            held = min(WINDOW, length) if layer in config.window_layers else length
            assert k.shape == v.shape == (1, config.n_kv_heads, held, config.head_dim), (length, layer)
            assert k.untyped_storage().nbytes() == k.numel() * k.element_size()  # no larger storage behind
    greedy(decoder, PROMPT, NEW)
    assert [k.shape[2] for k, _ in decoder.cache] == [WINDOW, WINDOW, len(PROMPT) + NEW, len(PROMPT) + NEW]


def test_max_seq_len_only_sizes_the_rope_tables():
    """Rows of a longer table equal the model's own, bit for bit, on every layer (scaled or not), and the
    weights are the same tensors: so a decode past ``max_seq_len`` runs the model's own RoPE."""
    config = long_config("yarn x4, 4x the original length")
    longer = dataclasses.replace(config, max_seq_len=4 * config.max_seq_len)
    for layer in range(config.n_layers):
        own = config.rope_of(layer).build().cache
        assert torch.equal(dataclasses.replace(config.rope_of(layer), max_seq_len=longer.max_seq_len).build()
                           .cache[:config.max_seq_len], own)
        assert torch.equal(longer.rope_of(layer).build().cache[:config.max_seq_len], own)
    weights = long_weights(config)
    x = torch.tensor([PROMPT[:config.max_seq_len]])
    with torch.no_grad():
        assert torch.equal(model_from_weights(config, weights)(x), model_from_weights(longer, weights)(x))


@pytest.fixture(scope="module")
def exports(references, tmp_path_factory) -> dict:
    """case -> the HF export of its weights, loaded by transformers with trust_remote_code."""
    from transformers import AutoModelForCausalLM  # here: the 8 ranks of tests/e2e import this file's helpers

    from models.laneformer.hf.export import export_hf

    out = {}
    for case, (config, weights, *_) in references.items():
        folder = export_hf(weights, config, tmp_path_factory.mktemp("long") / "hf")
        out[case] = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    return out


@pytest.mark.parametrize("case", CASES)
def test_hf_generate_equals_full_forwards_past_the_base_length(references, exports, case):
    config, _, ids, logits = references[case]
    out = exports[case].generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    assert out.sequences[0, len(PROMPT):].tolist() == ids
    torch.testing.assert_close(torch.cat(out.scores), logits, rtol=1e-4, atol=1e-4)
    # transformers' cache (layer_types): WINDOW - 1 keys on window layers (the query is the window's last),
    # every position but the last generated on full layers
    cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
    assert [layer.keys.shape[2] for layer in cache.layers] == [WINDOW - 1] * 2 + [len(PROMPT) + NEW - 1] * 2


def test_hf_generate_past_max_position_embeddings_needs_max_new_tokens(exports):
    """Without ``max_new_tokens`` transformers caps the length at ``max_position_embeddings`` (the exported
    max_seq_len) and refuses a longer prompt; with it, it only warns (the test above)."""
    hf = exports["no scaling, 4x max_seq_len"]
    with pytest.raises(ValueError, match=rf"Input length of input_ids is {len(PROMPT)}, but `max_length` is set to "
                                         rf"{BASE}\. .*setting `max_new_tokens`"):
        hf.generate(torch.tensor([PROMPT]), do_sample=False, pad_token_id=0)
