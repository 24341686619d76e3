"""The KV-cache decoder (models.laneformer.generate) against the model itself, and its weight slicing.

The reference is ``Laneformer.forward`` recomputing the whole sequence (no
cache, the training code path): the decoder's logits at every step must match
it for every exchange variant the config supports, with sliding windows that
bind. The lane-parallel runs (several processes) are in tests/e2e.
"""

import dataclasses

import pytest
import torch

from models.laneformer import laneformer_configs, write_native_config
from models.laneformer.checkpoint import LANE_WEIGHT, open_checkpoint
from models.laneformer.generate import LaneDecoder, greedy, lane_range, random_weights
from models.laneformer.hf.checkpoint_io import save_dcp
from models.laneformer.hf.export import export_hf
from tests.models.conftest import DECODE_PROMPT, DECODE_VARIANTS, decode_config, model_from_weights

BASE = decode_config()
VARIANTS = DECODE_VARIANTS
PROMPT = DECODE_PROMPT
NEW = 5


def stepwise_logits(decoder: LaneDecoder, ids: list[int], prompt: list[int] = PROMPT) -> torch.Tensor:
    """The decoder's next-token logits after the prompt and after each of ``ids`` but the last."""
    decoder.reset(1, len(prompt) + len(ids))
    out = [decoder.forward(torch.tensor([prompt]), 0)[0]]
    for k, token in enumerate(ids[:-1]):
        out.append(decoder.forward(torch.tensor([[token]]), len(prompt) + k)[0])
    return torch.stack(out)


@pytest.fixture(scope="module")
def decoded() -> dict[str, tuple[list[int], torch.Tensor, torch.Tensor]]:
    """variant -> (greedy ids, decoder logits per step, model logits at the same positions)."""
    out = {}
    for name, overrides in VARIANTS.items():
        config = decode_config(**overrides)
        weights = random_weights(config, range(config.n_lanes), seed=1)
        decoder = LaneDecoder(config, weights, range(config.n_lanes), torch.device("cpu"))
        ids = greedy(decoder, PROMPT, NEW).ids
        with torch.no_grad():
            reference = model_from_weights(config, weights)(torch.tensor([PROMPT + ids]))[0, len(PROMPT) - 1:-1]
        out[name] = (ids, stepwise_logits(decoder, ids), reference)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_kv_cache_decode_equals_the_model(decoded, variant):
    ids, logits, reference = decoded[variant]
    assert len(ids) == NEW
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    assert reference.argmax(-1).tolist() == ids  # greedy on the model's own logits


def test_variants_are_different_models(decoded):
    """Every variant changes the logits: the equality above is not vacuous."""
    names = list(VARIANTS)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert (decoded[a][2] - decoded[b][2]).abs().max() > 1e-2, (a, b)


def test_any_lane_split_makes_the_same_random_model():
    whole = random_weights(BASE, range(8), seed=3)
    part = random_weights(BASE, range(2, 4), seed=3)
    for name, t in whole.items():
        torch.testing.assert_close(part[name], t[2:4] if LANE_WEIGHT.fullmatch(name) else t, rtol=0, atol=0)


def test_weights_are_sliced_from_hf_and_dcp_checkpoints(tmp_path):
    config = dataclasses.replace(laneformer_configs["tiny"](), delay=1, late_mode="flush")
    whole = random_weights(config, range(8), seed=2)
    export_hf(whole, config, tmp_path / "hf", max_shard_bytes=2_000_000)  # several shards
    save_dcp(whole, tmp_path / "dcp")
    write_native_config(config, tmp_path / "dcp")  # as from-hf and the trainer do
    for folder in ("hf", "dcp"):
        checkpoint = open_checkpoint(tmp_path / folder)
        assert checkpoint.kind == folder.replace("dcp", "step")
        got_config = checkpoint.model_config()
        assert (got_config.delay, got_config.late_mode, got_config.n_layers) == (1, "flush", config.n_layers)
        got = checkpoint.load_weights(got_config, range(4, 6))
        assert got.keys() == whole.keys()
        for name, t in whole.items():
            assert torch.equal(got[name], t[4:6] if LANE_WEIGHT.fullmatch(name) else t), (folder, name)


def test_ranks_must_divide_the_lanes():
    assert lane_range(8, 3, 4) == range(6, 8)
    with pytest.raises(ValueError, match="3 ranks must divide model.n_lanes=8"):
        lane_range(8, 0, 3)


# --- the CLI's tokenizer: the checkpoint's own (Checkpoint.open_tokenizer), never the tiny default ---

TEXT = "an ace can dance"


def test_the_cli_decodes_with_the_tokenizer_the_run_names(tmp_path, capsys):
    from data.tokenizer import TINY_TOKENIZER, Tokenizer
    from models.laneformer.generate import main
    from tests.conftest import other_tokenizer, write_tiny_run

    other = other_tokenizer(tmp_path / "tok")
    prompt = Tokenizer(other).encode(TEXT, bos=True)
    assert prompt != Tokenizer(TINY_TOKENIZER).encode(TEXT, bos=True)
    write_tiny_run(tmp_path / "run", other)
    ids = main(["--checkpoint", str(tmp_path / "run"), "--prompt", TEXT, "--max-new-tokens", "3"])
    assert f"tokenizer {other} (from {tmp_path / 'run' / 'recipe.toml'}" in capsys.readouterr().err
    checkpoint = open_checkpoint(tmp_path / "run")
    config = checkpoint.model_config()
    decoder = LaneDecoder(config, checkpoint.load_weights(config, range(config.n_lanes)),
                          range(config.n_lanes), torch.device("cpu"))
    assert ids == greedy(decoder, prompt, 3, Tokenizer(other).eos_id).ids  # the prompt in the run's ids


def test_the_cli_refuses_a_checkpoint_whose_tokenizer_it_cannot_find(tmp_path):
    from models.laneformer.generate import main
    from tests.conftest import write_tiny_run

    step = write_tiny_run(tmp_path / "run", None)
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / 'run'}: cannot tell which tokenizer .*{step}: no "
                                                r"tokenizer files and no \S*recipe\.toml naming one; pass --tokenizer"):
        main(["--checkpoint", str(tmp_path / "run"), "--prompt", TEXT, "--max-new-tokens", "1"])
