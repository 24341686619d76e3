"""Predict a big run's loss from small ones: ``L(C) = a * C^(-b) + c`` fitted to final loss
against training FLOPs, with its uncertainty, and read at the 2B recipe's compute.

The fit: for a fixed exponent ``b`` the law is linear in ``a`` and ``c``, solved exactly by least
squares; ``b`` is then the one-dimensional minimum of the residual (a grid, every exponent of it
solved at once, then scipy's bounded Brent search between the grid's neighbours): no starting guess
to get wrong. The uncertainty is the usual linearised one: the parameters' covariance
``s^2 (J^T J)^-1`` from the Jacobian at the optimum with ``s^2`` the residual variance over ``n - 3``
degrees of freedom, and a prediction's standard error by the delta method (both checked against
the spread of fits of a known law with noise added). With 4 sizes that is 1 degree of freedom: the
error bars are wide, and say so.

What it can and cannot promise: it interpolates the sizes it saw and extrapolates along the same
law; it assumes every size was trained the same way (same data, schedule shape, tokens per
parameter rule) and that the law holds beyond them. It cannot foresee a change of regime (an
instability at scale, data repeated in the long run, a learning rate that does not transfer),
and a prediction orders of magnitude beyond the largest run is as good as that assumption.

Training FLOPs of a run: its FLOPs per token (models/laneformer/flops.py, as MFU counts them) x
the tokens it trained; the 2B's: the same for ``recipes/phase1.toml``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar

MIN_SIZES = 4  # model sizes a fit needs: 3 parameters and at least one degree of freedom
B_RANGE = (1e-3, 2.0)  # exponents searched, wide around published ones (Kaplan et al. 2020, loss vs compute: 0.050)


@dataclass
class Fit:
    a: float
    b: float
    c: float
    cov: np.ndarray  # of (a, b, c); NaN where there is no degree of freedom
    n: int
    rss: float
    scale: float  # FLOPs the fit normalised C by (for conditioning); a is in unnormalised units

    @property
    def errors(self) -> tuple[float, float, float]:
        return tuple(float(math.sqrt(v)) if v >= 0 else math.nan for v in np.diag(self.cov))

    def predict(self, flops: float) -> tuple[float, float]:
        """(loss, its standard error) at ``flops``."""
        x = flops ** -self.b
        grad = np.array([x, -self.a * x * math.log(flops), 1.0])
        return self.a * x + self.c, float(math.sqrt(max(grad @ self.cov @ grad, 0.0)))


def _linear(x: np.ndarray, y: np.ndarray) -> tuple:
    """(a, c, rss) of the least-squares ``y = a x + c`` (centred normal equations); a 2-D ``x`` fits
    each row, one per candidate exponent, at once."""
    x_mean = x.mean(axis=-1, keepdims=True)
    dx = x - x_mean
    a = (dx @ (y - y.mean())) / np.sum(dx * dx, axis=-1)
    c = y.mean() - a * x_mean[..., 0]
    return a, c, np.sum((a[..., None] * x + c[..., None] - y) ** 2, axis=-1)


def fit_power_law(flops, losses, b_range: tuple[float, float] = B_RANGE) -> Fit:
    """Least-squares ``losses = a * flops^(-b) + c`` (see the module's docstring)."""
    C, L = np.asarray(flops, dtype=float), np.asarray(losses, dtype=float)
    if len(C) < 3 or len(set(C.tolist())) < 3:
        raise ValueError(f"a power law with an offset needs at least 3 distinct compute values, got {len(set(C))}")
    scale = float(np.exp(np.mean(np.log(C))))  # the geometric mean: x stays near 1 for every b
    u = C / scale
    rss = lambda b: _linear(u ** -b, L)[2]
    grid = np.linspace(*b_range, 400)
    i = int(np.argmin(_linear(u ** -grid[:, None], L)[2]))
    bracket = (grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)])  # around the grid's best
    b = float(minimize_scalar(rss, bounds=bracket, method="bounded", options={"xatol": 1e-12}).x)
    a_u, c, r = (float(v) for v in _linear(u ** -b, L))
    a = a_u * scale ** b  # a * C^-b == a_u * (C/scale)^-b
    # Covariance in (a_u, b, c), normalised units, then a's row and column mapped to a.
    x = u ** -b
    J = np.stack([x, -a_u * x * np.log(u), np.ones_like(x)], axis=1)
    dof = len(C) - 3
    cov = np.full((3, 3), math.nan)
    if dof > 0:
        cov = (r / dof) * np.linalg.pinv(J.T @ J)
        # a = a_u * scale^b: da = scale^b da_u + a ln(scale) db
        T = np.array([[scale ** b, a * math.log(scale), 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
        cov = T @ cov @ T.T
    return Fit(a, b, c, cov, len(C), r, scale)


def flops_per_token(config, seq_len: int) -> int:
    """Training FLOPs per token of a model config (models/laneformer/flops.py, as MFU counts them)."""
    import torch

    with torch.device("meta"):
        model = config.build()
    return config.get_nparams_and_flops(model, seq_len)[1]


def recipe_flops(name: str = "phase1.toml") -> float:
    """Training FLOPs of a recipe: FLOPs per token x its total tokens."""
    from train import recipe as R
    from train.recipe import model_config

    recipe = R.load(name)
    return float(flops_per_token(model_config(recipe), recipe.training.seq_len) * recipe.training.total_tokens)


def run_points(runs, metric: str) -> list[tuple[str, int, float, float]]:
    """(run, parameters, training FLOPs, final loss) of each run: its last logged ``metric``."""
    import torch

    from models.laneformer import read_native_config

    points = []
    for run in runs:
        steps, values = run.series(metric)
        try:
            config = read_native_config(run.path)
        except (OSError, ValueError, TypeError):  # no laneformer_config.json yet, or another version's
            continue
        if not steps:
            continue
        with torch.device("meta"):
            nparams = sum(p.numel() for p in config.build().parameters())
        per_token = flops_per_token(config, run.recipe["training"]["seq_len"])
        points.append((run.path.name, nparams, per_token * run.tokens(steps[-1]), values[-1]))
    return points


def scaling_lines(runs, metric: str, target: str = "phase1.toml") -> list[str]:
    """The fit and the predicted loss at ``target``'s compute, when the runs span >= 4 model sizes;
    nothing otherwise (a sweep of one size has no scaling to fit)."""
    points = run_points(runs, metric)
    if len({p[1] for p in points}) < MIN_SIZES:
        return []
    fit = fit_power_law([p[2] for p in points], [p[3] for p in points])
    ea, eb, ec = fit.errors
    target_flops = recipe_flops(target)
    loss, se = fit.predict(target_flops)
    largest = max(p[2] for p in points)
    bound = [f"  b is at the edge of the range searched ({B_RANGE[0]:g}-{B_RANGE[1]:g}): these losses do not follow "
             "the law; the prediction below means nothing"] if min(abs(fit.b - x) for x in B_RANGE) < 1e-3 else []
    return [
        f"scaling fit over {len({p[1] for p in points})} model sizes ({fit.n} runs), final {metric} against "
        f"training FLOPs: L(C) = a * C^(-b) + c",
        f"  a = {fit.a:.4g} +- {ea:.2g}, b = {fit.b:.4f} +- {eb:.2g}, c = {fit.c:.4f} +- {ec:.2g} "
        f"({fit.n - 3} degrees of freedom, residual rms {math.sqrt(fit.rss / fit.n):.4f})",
        f"  predicted at {target} ({target_flops:.3g} FLOPs, {target_flops / largest:.3g}x the largest run): "
        f"{loss:.4f} +- {se:.4f} (1 sigma, linearised; an extrapolation that assumes the law holds that far)",
        *bound,
    ]
