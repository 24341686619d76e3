"""RoPE per layer type: window layers keep ``rope_theta``; full layers take ``rope_theta_global`` and
``rope_scaling`` ("llama", "yarn"). Checked against frequencies computed here from the methods'
definitions (float64, not torchtitan's function), against a dense reference of the whole model, and
through the Hugging Face export at 4x the original length.

The references:

- Llama 3.1: Meta's reference code (llama-models, ``apply_scaling``; low_freq_factor 1, high_freq_factor 4):
  a wavelength over ``L`` turns ``s`` times slower, one under ``L/4`` keeps its speed, one between is
  blended by ``(L / wavelength - 1) / 3``.
- YaRN (arXiv 2309.00071, section 3.2, alpha 1, beta 32): with ``r(d) = L / wavelength(d)`` the turns of
  dimension ``d`` over the original length ``L``, dimensions with ``r > beta`` keep their speed, those with
  ``r < alpha`` turn ``s`` times slower. Between, the ramp is linear in ``d`` from the dimension where
  ``r = beta`` (floored) to the one where ``r = alpha`` (ceiled), as YaRN's published code and transformers
  compute it (the paper's text ramps linearly in ``r``; the released models use the code's ramp). The
  attention logits are scaled by ``(0.1 ln s + 1)^2`` (section 3.4).
"""

import dataclasses
import json
import math

import pytest
import torch
from torchtitan.models.common import ComplexRoPE

from models.laneformer import laneformer_configs
from models.laneformer.hf.config_map import native_from_hf
from models.laneformer.hf.export import export_hf
from models.laneformer.hf.kog_releases import laneformer_tp_keys
from tests.models.test_hf_export import load_hf, logits, random_model, tiny, tokens
from tests.models.test_model import build, dense_forward, theta_freqs

ORIGINAL = 64  # the tiny model's "trained" length here; its window (32) and max_seq_len (1024) are the flavor's
VARIANTS = {
    "theta_global": dict(rope_theta_global=500_000.0),
    "llama": dict(rope_scaling="llama", rope_scaling_factor=4.0, rope_original_seq_len=ORIGINAL),
    "yarn": dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_seq_len=ORIGINAL),
    "theta_global+yarn": dict(rope_theta_global=500_000.0, rope_scaling="yarn", rope_scaling_factor=4.0,
                              rope_original_seq_len=ORIGINAL),
}


def reference_rope(cfg, layer) -> tuple[torch.Tensor, float | None]:
    """(frequencies float64 [head_dim/2], attention scale or None) of a layer, from the definitions above."""
    hd = cfg.head_dim
    if cfg.window_of(layer) is not None:
        return theta_freqs(cfg.rope_theta, hd), None
    theta = cfg.rope_theta_global or cfg.rope_theta
    freqs, s, L = theta_freqs(theta, hd), cfg.rope_scaling_factor, cfg.rope_original_seq_len
    wavelength = 2 * math.pi / freqs
    if cfg.rope_scaling == "llama":
        blend = (L / wavelength - 1) / (4 - 1)
        blended = (1 - blend) * freqs / s + blend * freqs
        freqs = torch.where(wavelength < L / 4, freqs, torch.where(wavelength > L, freqs / s, blended))
    elif cfg.rope_scaling == "yarn":
        d = torch.arange(hd // 2, dtype=torch.float64)
        turns = L / wavelength  # r(d)
        dim_at = lambda r: hd * math.log(L / (2 * math.pi * r)) / (2 * math.log(theta))  # solves r(d) = r
        low, high = max(math.floor(dim_at(32)), 0), min(math.ceil(dim_at(1)), hd - 1)
        kept = ((d - low) / (high - low)).clamp(0, 1)  # 0: keep the speed, 1: s times slower
        freqs = freqs * (1 - kept) + freqs / s * kept
        assert torch.equal(freqs[turns > 32], theta_freqs(theta, hd)[turns > 32])
        assert torch.allclose(freqs[turns < 1], theta_freqs(theta, hd)[turns < 1] / s)
        return freqs, (0.1 * math.log(s) + 1) ** 2 / math.sqrt(hd)
    return freqs, None


def cache_freqs(model, layer) -> torch.Tensor:
    """The frequencies a layer rotates with, read back from its RoPE cache (position 1's angles)."""
    return model.layers[str(layer)].attention.rope.cache[1].angle().double()


def test_the_default_is_todays_model_bit_for_bit():
    """Every layer built as before this option existed: one ComplexRoPE(theta=rope_theta), SDPA's own scale."""
    model = build("tiny")
    cfg = model.config
    x = torch.randint(0, cfg.vocab_size, (2, 80))
    with torch.no_grad():
        now = model(x)
        for layer in model.layers.values():
            layer.attention.rope = ComplexRoPE.Config(
                dim=cfg.head_dim, max_seq_len=cfg.max_seq_len, theta=cfg.rope_theta).build()
            layer.attention.softmax_scale = None
        assert torch.equal(model(x), now)
    explicit = build("tiny", rope_theta_global=cfg.rope_theta)  # the same model, said explicitly
    with torch.no_grad():
        assert torch.equal(explicit(x), now)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_option_changes_only_the_full_layers(variant):
    default, model = build("tiny"), build("tiny", **VARIANTS[variant])
    cfg = model.config
    assert cfg.window_layers == [0, 1] and cfg.n_layers == 4
    for layer in range(cfg.n_layers):
        freqs, scale = reference_rope(cfg, layer)
        attention, before = model.layers[str(layer)].attention, default.layers[str(layer)].attention
        torch.testing.assert_close(cache_freqs(model, layer), freqs, rtol=1e-6, atol=0)
        assert attention.softmax_scale == pytest.approx(scale)
        assert torch.equal(attention.rope.cache, before.rope.cache) == (layer in cfg.window_layers), layer


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_model_equals_a_dense_reference_with_these_rotations(variant):
    """delay 0: the model is a dense transformer (test_model), here with the reference's rotations and scales."""
    model = random_model(tiny(delay=0, **VARIANTS[variant]))
    cfg, x = model.config, tokens(model.config, 4 * ORIGINAL, batch=1)
    with torch.no_grad():
        got = model(x)
        assert (got - dense_forward(model.state_dict(), cfg, x, lambda i: reference_rope(cfg, i))).abs().max() <= 1e-4
        assert (got - dense_forward(model.state_dict(), cfg, x)).abs().max() > 1e-2  # not today's model


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_computes_the_same_logits_at_4x_the_original_length(variant, tmp_path):
    config = tiny(**VARIANTS[variant])
    model = random_model(config)
    export_hf(model.state_dict(), config, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: written[k] for k in ("rope_theta", "rope_theta_global", "rope_scaling_type", "rope_scaling_factor",
                                    "rope_original_max_position_embeddings")} == {
        "rope_theta": config.rope_theta, "rope_theta_global": config.rope_theta_global,
        "rope_scaling_type": config.rope_scaling, "rope_scaling_factor": config.rope_scaling_factor,
        "rope_original_max_position_embeddings": config.rope_original_seq_len}
    x = tokens(config, 4 * ORIGINAL, batch=1)
    assert (logits(model, x) - logits(load_hf(tmp_path / "hf"), x)).abs().max().item() <= 1e-4
    fields, absent, _ = native_from_hf(written)  # what convert from-hf reads back
    assert not absent
    assert {k: fields[k] for k in VARIANTS[variant]} == VARIANTS[variant]


def test_a_config_without_the_keys_is_one_rope_on_every_layer(tmp_path):
    """Kog's releases and earlier exports carry none of the new keys: they read as today's model."""
    config = tiny(**VARIANTS["theta_global+yarn"])
    export_hf(random_model(config).state_dict(), config, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    new = {"rope_theta_global", "rope_scaling_type", "rope_scaling_factor", "rope_original_max_position_embeddings"}
    fields, absent, _ = native_from_hf({k: v for k, v in written.items() if k not in new})
    assert set(absent) == set(VARIANTS["theta_global+yarn"])
    back = dataclasses.replace(config, **fields)
    assert all(back.rope_of(i) == back.rope_of(0) and back.softmax_scale_of(i) is None for i in range(back.n_layers))


def test_kogs_older_code_is_not_claimed_for_a_per_layer_rope():
    two_b = laneformer_configs["2B"]()
    for variant in VARIANTS.values():
        keys, why = laneformer_tp_keys(dataclasses.replace(two_b, early_send_forward=True, **variant))
        assert not keys and any("rope_theta alone" in w for w in why)
    assert laneformer_tp_keys(dataclasses.replace(two_b, early_send_forward=True))[0]


@pytest.mark.parametrize("changes,field", [
    (dict(rope_scaling="yarn"), "rope_scaling_factor"),  # factor 1: no scaling at all
    (dict(rope_scaling="ntk", rope_scaling_factor=2.0), "rope_scaling"),
    (dict(rope_original_seq_len=0), "rope_original_seq_len"),
])
def test_bad_rope_settings_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"model.{field} "):
        dataclasses.replace(laneformer_configs["tiny"](), **changes)
