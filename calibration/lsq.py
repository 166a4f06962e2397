"""Small deterministic least-squares solvers for the cost-model fit (numpy; no scipy).

Owns: `nnls` (Lawson-Hanson non-negative least squares), `levenberg_marquardt` (for a few
nonlinear parameters, forward-difference Jacobian) and `fit_roofline` / `fit_linear_rel`
(the operator-profile curves). Used only by calibration/fit.py, never at run time.

Must not import: ray, torch (numpy is fine here: this is fitting code, not the hot path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Residuals = Callable[[np.ndarray], np.ndarray]


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson, 1974)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
        w = a.T @ (b - a @ x)
    return x


def levenberg_marquardt(residuals: Residuals, x0: Sequence[float], max_iter: int = 200,
                        tol: float = 1e-12) -> tuple[np.ndarray, float]:
    """Minimise ||residuals(x)||^2 from x0; returns (x, cost). Deterministic."""
    x = np.asarray(x0, dtype=float)
    r = residuals(x)
    cost = float(r @ r)
    lam = 1e-3
    for _ in range(max_iter):
        jac = np.empty((r.size, x.size))
        for i in range(x.size):
            h = 1e-7 * max(1.0, abs(x[i]))
            dx = np.zeros_like(x)
            dx[i] = h
            jac[:, i] = (residuals(x + dx) - r) / h
        jtj, grad = jac.T @ jac, jac.T @ r
        improved = False
        while lam < 1e10:
            step = np.linalg.solve(jtj + lam * (np.diag(np.diag(jtj)) + 1e-12 * np.eye(x.size)), -grad)
            cand = x + step
            rc = residuals(cand)
            cc = float(rc @ rc)
            if np.isfinite(cc) and cc < cost:
                improved = cost - cc > tol * max(cost, 1e-30)
                x, r, cost = cand, rc, cc
                lam = max(lam / 3.0, 1e-9)
                break
            lam *= 4.0
        if not improved:
            break
    return x, cost


def fit_roofline(curve: Sequence[tuple[int, float]],
                 smoothness: Sequence[float] = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0)) -> tuple[float, float, float, float]:
    """Fit `(floor^p + (slope*x)^p)^(1/p)` to (x, y) in log space. Returns (floor, slope, p, rms log error)."""
    x = np.array([c[0] for c in curve], dtype=float)
    y = np.array([c[1] for c in curve], dtype=float)
    floor0 = float(np.median(y[x <= max(8.0, x.min())]))
    slope0 = float(y[-1] / x[-1])
    best: tuple[float, float, float, float] | None = None
    for p in smoothness:
        def res(theta: np.ndarray, p: float = p) -> np.ndarray:
            floor, slope = np.exp(theta)
            out: np.ndarray = np.log((floor ** p + (slope * x) ** p) ** (1.0 / p) / y)
            return out

        theta, cost = levenberg_marquardt(res, [np.log(floor0), np.log(slope0)])
        rms = float(np.sqrt(cost / x.size))
        if best is None or rms < best[3] - 1e-12:
            best = (float(np.exp(theta[0])), float(np.exp(theta[1])), p, rms)
    assert best is not None
    return best


def fit_linear_rel(features: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares in relative error: minimise sum((f.c - y)/y)^2. Returns (c, rms rel error)."""
    w = 1.0 / y
    coef = nnls(features * w[:, None], np.ones_like(y))
    rel = features @ coef / y - 1.0
    return coef, float(np.sqrt(np.mean(rel ** 2)))
