"""Hugging Face export and import of Laneformer checkpoints, checked against the training model.

The HF modeling file re-implements the model in plain torch, so these tests
are what ties the two together: same logits (max abs diff <= 1e-5, fp32) for
the tiny flavor, for the 2B's lane/head layout and for non-default exchange
settings; cached generation equal to a no-cache argmax loop past the window;
exact weight round trips; a released-layout folder written independently of
the exporter; clear refusals of truncated or mismatched weights; and exports
of a run that carry its tokenizer (issue 13), checked with transformers and
``eval.run``. Kog's own code is the reference in ``test_kog_import.py``.
"""

import dataclasses
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from data.tokenizer import TINY_TOKENIZER
from models.laneformer import laneformer_configs, native_fields, read_native_config, write_native_config
from models.laneformer.attention import DenseMaskFlexAttention
from models.laneformer.convert import main as convert_main
from models.laneformer.hf.checkpoint_io import load_dcp, save_dcp
from models.laneformer.hf.export import export_hf, to_hf
from models.laneformer.hf.import_hf import import_hf
from models.laneformer.model import Laneformer
from tests.eval.conftest import write_toy_core_bundle

# SDPA with the BlockMask's own mask_mod: no flex compile on CPU
CPU_ATTENTION = {"inner_attention": DenseMaskFlexAttention.Config()}

TOL = 1e-5


def tiny(**changes) -> Laneformer.Config:
    return dataclasses.replace(laneformer_configs["tiny"](), **CPU_ATTENTION, **changes)


def two_b_layout(**changes) -> Laneformer.Config:
    """3 layers with the 2B's lanes and heads (8 lanes, 32/16 heads of 96), narrower elsewhere."""
    return Laneformer.Config(
        dim=384, n_layers=3, n_heads=32, n_kv_heads=16, head_dim=96, ffn_hidden_dim=1024,
        vocab_size=512, max_seq_len=256, n_lanes=8, delay=2, window_size=16, window_layers=[0, 2],
        **CPU_ATTENTION, **changes,
    )


def random_model(config: Laneformer.Config, seed: int = 0) -> Laneformer:
    """Weights large enough that lanes, norms and the exchange all move the logits."""
    model = Laneformer(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "tok_embeddings" in name else 0.08))
    return model


def logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def load_hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


def tokens(config, length, batch=2, seed=1):
    return torch.randint(0, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


NON_DEFAULT = {
    "scaled+flush+norm_of_sum+send": dict(early_mode="scaled", late_mode="flush", final_agg="norm_of_sum",
                                          early_send_forward=True),
    "delay1+late_present": dict(delay=1, late_mode="present"),
    "delay0_dense": dict(delay=0),
    "no_delayed_exchange": dict(delayed_exchange=False),
    "3_layers_delay2_send": dict(n_layers=3, early_send_forward=True),  # layer 1's send lands past the end
}


@pytest.mark.parametrize(
    "config",
    [tiny(), two_b_layout(), *(tiny(**c) for c in NON_DEFAULT.values())],
    ids=["tiny", "2B-layout", *NON_DEFAULT],
)
def test_export_logits_match_training_model(config, tmp_path):
    model = random_model(config)
    export_hf(model.state_dict(), config, tmp_path / "hf")
    hf = load_hf(tmp_path / "hf")
    x = tokens(config, 48)  # longer than every window
    assert config.window_layers and x.shape[1] > config.window_size
    assert (logits(model, x) - logits(hf, x)).abs().max().item() <= TOL
    hf_fields = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("early_mode", "early_send_forward", "late_mode", "final_agg", "head_dim", "swa_layers", "use_comm"):
        assert key in hf_fields
    assert hf.config.broadcast_delay == config.delay and hf.config.late_mode == config.late_mode


def test_exchange_settings_change_the_function(tmp_path):
    """The non-default settings above are not no-ops, so matching logits prove they round-trip."""
    model = random_model(tiny())
    x = tokens(tiny(), 40)
    base = logits(model, x)
    for changes in NON_DEFAULT.values():
        other = random_model(tiny(**changes))
        assert (logits(other, x) - base).abs().max() > 1e-3, changes


def test_generate_with_cache_matches_argmax_loop(tmp_path):
    config = tiny()
    export_hf(random_model(config).state_dict(), config, tmp_path / "hf")
    hf = load_hf(tmp_path / "hf")
    prompt = tokens(config, 20)
    n_new = 2 * config.window_size  # decode well past the window
    out = hf.generate(prompt, max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0,
                      output_scores=True, return_dict_in_generate=True)
    seq = prompt
    for step in range(n_new):
        with torch.no_grad():
            step_logits = hf(seq, use_cache=False).logits[:, -1]
        assert (step_logits - out.scores[step]).abs().max().item() <= TOL, step
        seq = torch.cat([seq, step_logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.sequences, seq)
    assert seq.shape[1] > 2 * config.window_size


def test_left_padded_batch_generates_like_single_prompts(tmp_path):
    config = tiny()
    export_hf(random_model(config).state_dict(), config, tmp_path / "hf")
    hf = load_hf(tmp_path / "hf")
    long, short = tokens(config, 30, batch=1), tokens(config, 22, batch=1, seed=2)
    greedy = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 8, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :8] = 0
    out = hf.generate(batch, attention_mask=mask, **greedy)
    assert torch.equal(out[0], hf.generate(long, **greedy)[0])
    assert torch.equal(out[1, 8:], hf.generate(short, **greedy)[0])


def test_roundtrip_to_hf_from_hf_is_exact(tmp_path):
    config = tiny(late_mode="flush", window_layers=[1, 3])
    model = random_model(config)
    state = model.state_dict()
    to_hf(model, tmp_path / "hf")  # the end-of-run hook's entry point
    report = import_hf(tmp_path / "hf", tmp_path / "dcp")
    assert report.mapping.revision == "laneformer (a project export)"
    assert not [f for f, source in report.mapping.sources.items() if "absent" in source]
    back_config = read_native_config(tmp_path / "dcp" / "laneformer_config.json")
    assert native_fields(back_config) == native_fields(config)
    back = load_dcp(tmp_path / "dcp", back_config)
    assert back.keys() == state.keys()
    for k, v in state.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_cli_to_hf_picks_latest_complete_step(tmp_path, capsys):
    config = tiny()
    run = tmp_path / "run"
    for step, seed in ((10, 0), (20, 1)):
        save_dcp(random_model(config, seed).state_dict(), run / "checkpoints" / f"step-{step}")
    (run / "checkpoints" / "step-30").mkdir()  # being written: no .metadata yet
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.model").write_text("x")
    (tok / "tokenizer_config.json").write_text("{}")  # the export adds the chat template to it
    (tmp_path / "evals.json").write_text(json.dumps({"hellaswag": 0.3125, "core": 0.21}))

    convert_main([
        "to-hf", str(run), str(tmp_path / "hf"), "--flavor", "tiny", "--tokenizer", str(tok),
        "--recipe", "tiny-cpu", "--tokens-seen", "1234567", "--evals", str(tmp_path / "evals.json"),
        "--max-shard-size", "3MB", "--dtype", "bfloat16",
    ])
    out = tmp_path / "hf"
    assert "step-20" in capsys.readouterr().out
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer.model").exists()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    readme = (out / "README.md").read_text()
    for text in ("tiny-cpu", "1,234,567", "hellaswag", "0.3125", "step: 20"):
        assert text in readme
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert hf.dtype == torch.bfloat16
    expected = random_model(config, 1).state_dict()["layers.0.attention.wq.weight"].bfloat16()
    assert torch.equal(hf.model.layers[0].attention.wq.weight, expected)
    assert not list(tmp_path.glob(".hf.tmp-*"))


def write_released_folder(folder, model, config, **extra_keys):
    """A folder the way Kog's release has it, written without the exporter."""
    folder.mkdir()
    weights = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v.contiguous()
               for k, v in model.state_dict().items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    released = {
        "model_type": "laneformer_tp",
        "architectures": ["LaneformerTPForCausalLM"],
        "hidden_size": config.dim, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "intermediate_size": config.ffn_hidden_dim, "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len, "rope_theta": config.rope_theta,
        "norm_eps": config.norm_eps, "num_lanes": config.n_lanes, "broadcast_delay": config.delay,
        "use_comm": True, "use_early_comm": config.early_mode == "present", "lm_head_type": "replicate",
        "pre_norm_lane_agg": config.final_agg == "norm_of_sum", "replicated_rmsn_scale": True,
        "tie_word_embeddings": False, "sliding_window": config.window_size,
        "sliding_window_n_layers": len(config.window_layers), "multiple_of": 256,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
        **extra_keys,
    }
    (folder / "config.json").write_text(json.dumps(released))
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY_TOKENIZER.parent / name, folder / name)


def test_cli_from_hf_then_to_hf_with_overrides(tmp_path, capsys):
    config = tiny(dim=128, n_heads=8, head_dim=16)
    model = random_model(config, seed=4)
    write_released_folder(tmp_path / "released", model, config)
    convert_main(["from-hf", str(tmp_path / "released"), str(tmp_path / "dcp"), "--set", "early_send_forward=false"])
    report = capsys.readouterr().out
    assert "head_dim = 16  <- hidden_size // num_attention_heads" in report and "late_mode = 'drop'" in report
    assert "early_send_forward = False  <- --set" in report
    assert read_native_config(tmp_path / "dcp" / "laneformer_config.json").early_send_forward is False

    # The import carried the folder's tokenizer, so the export needs no --tokenizer.

    convert_main(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf")])  # config from laneformer_config.json
    hf = load_hf(tmp_path / "hf")
    assert hf.config.early_send_forward is False and hf.config.swa_layers == config.window_layers
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == (TINY_TOKENIZER.parent / "tokenizer.json").read_text()
    assert torch.equal(hf.lm_head.weight, model.lm_head.weight)


def test_truncated_safetensors_is_refused(tmp_path):
    config = tiny()
    export_hf(random_model(config).state_dict(), config, tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1000])
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated .*tensor '[\w.]+'"):
        import_hf(tmp_path / "hf", tmp_path / "out")
    weights.write_bytes(data[:20])
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated"):
        import_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("intermediate_size", 256, r"'model\.layers\.0\.feed_forward\.w1\.weight' in \S*model\.safetensors "
                                   r"has shape \[8, 64, 128\], the config implies \[8, 32, 128\]"),
        ("num_hidden_layers", 3, r"unexpected tensors: 'model\.layers\.3\.attention\.wk\.weight' \(\S*model\.safetensors\)"),
        ("num_hidden_layers", 5, r"missing tensors: \['model\.layers\.4\."),
    ],
)
def test_config_not_matching_weights_is_refused(tmp_path, key, value, message):
    config = tiny()
    write_released_folder(tmp_path / "released", random_model(config), config, **{key: value})
    with pytest.raises(ValueError, match=message) as err:
        import_hf(tmp_path / "released", tmp_path / "out")
    assert "config.json" in str(err.value)
    assert not (tmp_path / "out").exists()


def write_run(run, config, seed=0, tokenizer=TINY_TOKENIZER, sources=("assets/sample_data/prose",)):
    """A run dir as training leaves it: resolved recipe, model config, one complete checkpoint."""
    model = random_model(config, seed)
    save_dcp(model.state_dict(), run / "checkpoints" / "step-5")
    write_native_config(config, run)
    lines = ["[data]", f'tokenizer = "{tokenizer}"']
    for i, path in enumerate(sources):
        lines += ["[[data.sources]]", f'name = "s{i}"', f'path = "{path}"', "weight = 1.0"]
    (run / "recipe.toml").write_text("\n".join(lines) + "\n")
    return model


def test_export_of_a_run_is_self_contained(tmp_path, capsys):
    """No --tokenizer: the run's recipe names it; transformers and eval.run need nothing else."""
    from transformers import AutoTokenizer

    from data.tokenizer import Tokenizer
    from eval.run import main as eval_main

    config = tiny()
    model = write_run(tmp_path / "run", config)
    convert_main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf")])
    printed = capsys.readouterr().out
    assert "fingerprint matches 1 data manifest(s)" in printed and "laneformer_tp code reads this export: no" in printed

    hf_tok, sp = AutoTokenizer.from_pretrained(tmp_path / "hf"), Tokenizer(TINY_TOKENIZER)
    text = "def f(x):\n    return x ** 2  # café"
    ids = hf_tok(text)["input_ids"]
    assert ids == sp.encode(text, bos=True)
    assert hf_tok.decode(ids, skip_special_tokens=True) == sp.decode(ids) == text
    x = torch.tensor([sp.encode(text, bos=True)])
    assert (logits(model, x) - logits(load_hf(tmp_path / "hf"), x)).abs().max().item() <= TOL

    core = write_toy_core_bundle(tmp_path / "core")  # eval.run reads the export with nothing else
    out = eval_main(["--checkpoint", str(tmp_path / "hf"), "--core", str(core), "--core-tasks", "copa",
                     "--max-per-task", "2"])
    assert "core/copa/acc" in out["metrics"]


def test_export_refuses_a_tokenizer_it_cannot_find_or_trust(tmp_path, capsys):
    config = tiny()
    write_run(tmp_path / "gone", config, tokenizer="/nonexistent/tokenizer.model")
    write_run(tmp_path / "other", config, sources=(str(tmp_path / "data"),))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"tokenizer": {"fingerprint": "0" * 64}}))
    bare = tmp_path / "bare" / "checkpoints" / "step-1"
    save_dcp(random_model(config).state_dict(), bare)
    write_native_config(config, bare)
    for run, message in ((tmp_path / "gone", r"recipe\.toml: \[data\] tokenizer: .*/nonexistent/tokenizer\.model"),
                         (tmp_path / "other", r"recipe\.toml: \[data\] tokenizer: .* has fingerprint dc771a921ad4d438…, "
                                              r"but \S*manifest\.json says the run's data was tokenized with 0000"),
                         (bare, r"no tokenizer files and no \S*recipe\.toml naming one; pass --tokenizer")):
        with pytest.raises(SystemExit) as exit_:
            convert_main(["to-hf", str(run), str(tmp_path / "hf")])
        assert exit_.value.code == 2
        assert re.search(message, capsys.readouterr().err)
        assert not (tmp_path / "hf").exists()


def test_a_checkpoints_config_raises_instead_of_exiting(tmp_path):
    from models.laneformer.checkpoint import Checkpoint

    step = Checkpoint("step", tmp_path, tmp_path, None)
    with pytest.raises(ValueError, match="unknown flavor 'huge'"):
        step.model_config("huge")
    with pytest.raises(FileNotFoundError, match="laneformer_config.json"):
        step.model_config()
