"""models.laneformer.merge: the weighted average of checkpoints of one model, written as an HF export.

The averages are checked against tensors computed here from the inputs' own weights; the output is read
back as eval.run reads it (eval.load: transformers with the remote code, and the export's own tokenizer)
and as ``[checkpoint] init_from`` takes it; a DCP run dir mixes with an HF export; a different model is
refused naming the field; bad input exits 2 and a failed write leaves no OUT.
"""

import dataclasses
import json
import re

import pytest
import torch

from data.tokenizer import TINY_TOKENIZER
from models.laneformer import model_registry, write_native_config
from models.laneformer.checkpoint import open_checkpoint
from models.laneformer.hf.export import export_hf
from models.laneformer.merge import main
from models.laneformer.model import Laneformer
from tests.conftest import tiny_random_model, write_tiny_run
from tests.models.conftest import model_from_weights

TOKENS = torch.tensor([[1, 5, 9, 200, 31, 7, 4000, 12]])


def weights_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def export(folder, seed=0, **changes):
    """An HF export of a random tiny model (``changes``: other config fields), with the tiny tokenizer."""
    if changes:
        config = dataclasses.replace(model_registry("tiny", attn_backend="dense").model, **changes)
        torch.manual_seed(seed)
        model = Laneformer(config)
        model.init_states()
    else:
        model = tiny_random_model(seed)
    export_hf(weights_of(model), model.config, folder, tokenizer_dir=TINY_TOKENIZER.parent)
    return folder


def read(path):
    checkpoint = open_checkpoint(path)
    return checkpoint.load_weights(checkpoint.model_config())


def test_the_average_is_the_tensorwise_mean_and_loads_as_eval_run_and_init_from_read_it(tmp_path, capsys):
    from types import SimpleNamespace

    from eval.load import load_checkpoint
    from train.build.checks import initial_load

    a, b, out = export(tmp_path / "a", seed=0), export(tmp_path / "b", seed=1), tmp_path / "merged"
    assert main([str(out), str(a), str(b)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    wa, wb = read(a), read(b)
    expected = {k: ((wa[k].double() + wb[k].double()) / 2).to(wa[k].dtype) for k in wa}
    got = read(out)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert not torch.equal(got["layers.0.attention.wq.weight"], wa["layers.0.attention.wq.weight"])

    loaded = load_checkpoint(out, device="cpu")  # eval.run's path: transformers, the export's own tokenizer
    assert loaded.notes == [] and loaded.tokenizer.encode("hello", bos=True)[0] == 1
    with torch.no_grad():
        reference = model_from_weights(model_registry("tiny", attn_backend="dense").model, expected)(TOKENS)
        assert (loaded.model_fn(TOKENS) - reference).abs().max().item() <= 1e-5
    recipe = SimpleNamespace(path="r.toml", checkpoint=SimpleNamespace(init_from=str(out)))
    assert initial_load(recipe) == (str(out), True)  # what [checkpoint] init_from takes


def test_weights_pick_one_exactly_or_interpolate_across_a_run_dir_and_an_export(tmp_path):
    run, hf = tmp_path / "run", export(tmp_path / "hf", seed=1)
    write_tiny_run(run, TINY_TOKENIZER)  # a real DCP checkpoint, as training leaves it
    w_run, w_hf = read(run), read(hf)

    assert main([str(tmp_path / "first"), str(run), str(hf), "--weights", "1,0"]) == 0
    got = read(tmp_path / "first")
    for k, v in w_run.items():
        assert torch.equal(got[k], v), k
    assert (tmp_path / "first" / "tokenizer.model").read_bytes() == TINY_TOKENIZER.read_bytes()  # the run's

    assert main([str(tmp_path / "mix"), str(hf), str(run), "--weights", "0.25,0.75"]) == 0
    got = read(tmp_path / "mix")
    for k in w_hf:
        expected = (0.25 * w_hf[k].double() + 0.75 * w_run[k].double()).float()
        assert torch.equal(got[k], expected), k


@pytest.mark.parametrize("changes, field, values", [
    ({"n_layers": 3}, "n_layers", "4 .* 3"),
    ({"delay": 1}, "delay", "2 .* 1"),  # same shapes: only the config tells them apart
])
def test_checkpoints_of_different_models_are_refused_naming_the_field(tmp_path, capsys, changes, field, values):
    a, b, out = export(tmp_path / "a"), export(tmp_path / "b", **changes), tmp_path / "merged"
    assert main([str(out), str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"different models cannot be merged:\n  {field}: {values}", err), err
    assert f"in {a}, " in err and f" in {b}" in err
    assert not out.exists()


def test_a_different_field_in_a_runs_config_is_refused_too(tmp_path, capsys):
    run = tmp_path / "run"
    write_tiny_run(run, TINY_TOKENIZER)
    config = json.loads((run / "laneformer_config.json").read_text())
    write_native_config(dataclasses.replace(Laneformer.Config(**config), window_size=16), run)
    assert main([str(tmp_path / "out"), str(export(tmp_path / "hf")), str(run)]) == 2
    assert re.search(r"window_size: 32 in \S+/hf, 16 in \S+/run", capsys.readouterr().err)


@pytest.mark.parametrize("args, message", [
    (["{a}", "{gone}"], r"\S+/gone: does not exist"),
    (["{a}", "{a}", "--weights", "1"], r"1 weight\(s\) for 2 checkpoints"),
    (["{a}", "{a}", "--weights", "0.7,0.4"], r"they sum to 1\.1, not 1 \(weights are not normalised\)"),
    (["{a}", "{a}", "--weights", "1.5,-0.5"], r"each weight must be a finite number >= 0"),
    (["{a}", "{a}", "--weights", "a,b"], r"not a comma-separated list of numbers"),
    (["{a}"], r"give two or more checkpoints"),
])
def test_bad_input_exits_2_naming_it_and_writes_nothing(tmp_path, capsys, args, message):
    a = export(tmp_path / "a")
    out = tmp_path / "merged"
    argv = [arg.format(a=a, gone=tmp_path / "gone") for arg in args]
    assert main([str(out), *argv]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()
    out.mkdir()  # an existing OUT is kept unless --overwrite
    assert main([str(out), str(a), str(a)]) == 2
    assert "exists (pass --overwrite to replace it)" in capsys.readouterr().err


def test_a_failure_while_writing_leaves_no_out(tmp_path, monkeypatch):
    import models.laneformer.hf.export as exporter

    def half_then_fail(weights, folder, max_shard_bytes):
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    a, b, out = export(tmp_path / "a"), export(tmp_path / "b", seed=1), tmp_path / "merged"
    monkeypatch.setattr(exporter, "write_weights", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        main([str(out), str(a), str(b)])
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temporary folder left either
