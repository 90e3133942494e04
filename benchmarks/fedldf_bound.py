"""The FedLDF paper's Theorem 1, evaluated: how far FedLDF's loss can trail FedAvg's (analysis, not a method).

Kept beside the benchmark that reproduces the paper (``benchmarks/fedldf.py``) rather than in the package:
nothing in a run uses it.
"""

from __future__ import annotations

import math


def convergence_bound(xi1: float, xi2: float, eta: float, num_layers: float, beta: float, n: int, K: int,
                      G: float, *, t: int | None = None, initial_gap: float = 0.0) -> dict:
    """Theorem 1 of the FedLDF paper: how far FedLDF's loss can trail FedAvg's.

    With ``q = 1 - n/K`` (the fraction of clients left out of each layer)::

        A = 2·ξ₂·η²·L²·q·(1 + β·q)
        B = (ξ₁/ξ₂)·A + q·G²/2            (computed as 2·ξ₁·η²·L²·q·(1 + β·q) + q·G²/2,
                                           which is the same for ξ₂ > 0 and defined at ξ₂ = 0)
        F(Θ̂^{t+1}) - F(Θ̄^{t+1}) ≤ A^t·[F(Θ̂⁰) - F(Θ̄⁰)] + B·(1 - A^t)/(1 - A)

    stated under the condition ``0 < ξ₂ < 1 / (2·(1 + β)·η²·L²)``.  Θ̂ is FedLDF's
    global model, Θ̄ FedAvg's from the same starting point, ξ₁, ξ₂ the per-layer
    gradient-divergence constants of Assumption 2 (``||∇F_{k,l}||² ≤ ξ₁ + ξ₂·||∇F||²``),
    G the gradient bound of Assumption 3, β the smoothness constant of Assumption 1
    and η the learning rate.  For ``t → ∞`` the gap tends to ``B/(1 - A)``; at
    ``n = K``, ``q = 0`` and A = B = 0 (FedLDF is FedAvg).  A larger ``n`` lowers
    ``q``, hence A, B and the asymptotic gap.

    Where the text is ambiguous (equations are garbled in the conversion):

    * ``L`` is *not* a smoothness constant in the paper: Assumption 1 calls the
      smoothness β, and the proof brings ``L`` in through ``||Σ_l (Θ̂_l - Θ̄_l)|| ≤
      L·max_l ||Θ̂_l - Θ̄_l||`` (Eq. 13), i.e. ``L`` is the number of layers
      (argument ``num_layers``).
    * Substituting ``||∇F(Θ̂^t)||² ≤ 2β[F(Θ̂^t) - F(Θ̄^t)]`` (Eq. 15) into Eq. 14 would
      put a further factor 2β into A; the paper's A (Eqs. 9, 16) has none.  We
      implement the A the theorem states.
    * The stated condition is sufficient for ``A < 1`` at every n: it is the
      ``n = 0`` (``q = 1``) case of ``A < 1``, where A is largest.  The paper's remark
      says "A ≤ 1"; the geometric sum needs ``A < 1``, which ``contracts`` reports.
    * The theorem bounds round ``t+1`` with ``A^t``; ``bound`` follows it literally.

    Args:
      xi1, xi2, eta, num_layers, beta, n, K, G: the theorem's quantities (see above).
      t: optional round index; when given, ``bound`` is the right-hand side at ``t``.
      initial_gap: ``F(Θ̂⁰) - F(Θ̄⁰)`` (0 when both start from the same model).

    Returns:
      dict with ``A``, ``B``, ``q``, ``xi2_max`` (the condition's upper limit),
      ``condition_holds`` (``0 < ξ₂ < xi2_max``), ``contracts`` (``A < 1``),
      ``asymptotic_gap`` (``B/(1-A)``, inf unless A < 1) and, if ``t`` is given, ``bound``.

    Example::

        >>> r = convergence_bound(1.0, 0.1, 0.1, 2.0, 1.0, n=1, K=2, G=1.0)
        >>> round(r["A"], 6), round(r["B"], 6), r["condition_holds"]
        (0.006, 0.31, True)
    """
    if not 0 <= n <= K or K < 1:
        raise ValueError(f"need 0 ≤ n ≤ K and K ≥ 1, got n = {n}, K = {K}.")
    if min(xi1, xi2, eta, beta) < 0:
        raise ValueError("ξ₁, ξ₂, η and β must be ≥ 0.")
    q = 1.0 - n / K
    c = 2.0 * eta ** 2 * num_layers ** 2 * q * (1.0 + beta * q)
    a = xi2 * c
    b = xi1 * c + q * G ** 2 / 2.0
    xi2_max = 1.0 / (2.0 * (1.0 + beta) * eta ** 2 * num_layers ** 2) if eta and num_layers else math.inf
    out = {
        "A": a,
        "B": b,
        "q": q,
        "xi2_max": xi2_max,
        "condition_holds": bool(0 < xi2 < xi2_max),
        "contracts": bool(a < 1),
        "asymptotic_gap": b / (1.0 - a) if a < 1 else math.inf,
    }
    if t is not None:
        geometric = t if a == 1 else (1.0 - a ** t) / (1.0 - a)
        out["bound"] = a ** t * initial_gap + b * geometric
    return out
