"""Why a one-step delay hurts Adam: the stability limit of the momentum recursion, with and without the delay.

On a quadratic direction of curvature ``h`` (after Adam's preconditioning),
momentum SGD with learning rate ``lr`` is

    m_t = b1 m_{t-1} + (1 - b1) h x_{t-d},    x_{t+1} = x_t - lr m_t,

where ``d`` is the delay (0: the gradient at the current weights; 1:
ZeRO-Offload's delayed update, the gradient at the weights of one step
earlier). The recursion is stable while ``lr * h`` stays below a threshold.
Adam trains near that threshold (the "edge of stability", Cohen et al.
2022), so the threshold sets how sharp a region training can settle in.
This prints it for a few ``b1``: without delay it is ``(2 + 2 b1) / (1 - b1)``
(38 at b1 = 0.9), with one step of delay it is 1 for every ``b1``::

    python bench/analysis/delay_stability.py
"""

from __future__ import annotations

import numpy as np


def spectral_radius(a: float, b1: float, delay: int) -> float:
  """Largest |eigenvalue| of the linear recursion's companion matrix at ``a = lr * h``."""
  n = delay + 2  # state: x_t, ..., x_{t-delay}, m_{t-1}
  step = np.zeros((n, n))
  step[0, 0], step[0, n - 1] = 1.0, -b1  # x_{t+1} = x_t - m_t
  step[0, delay] -= (1 - b1) * a
  for i in range(1, delay + 1):
    step[i, i - 1] = 1.0
  step[n - 1, delay], step[n - 1, n - 1] = (1 - b1) * a, b1  # m_t
  return float(max(abs(np.linalg.eigvals(step))))


def threshold(b1: float, delay: int) -> float:
  """The largest ``lr * h`` at which the recursion is stable (bisection)."""
  lo, hi = 0.0, 1000.0
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if spectral_radius(mid, b1, delay) < 1 else (lo, mid)
  return lo


def main() -> None:
  print(f"{'b1':>5} {'no delay':>9} {'delay 1':>8}")
  for b1 in (0.0, 0.5, 0.9, 0.95):
    print(f"{b1:5.2f} {threshold(b1, 0):9.2f} {threshold(b1, 1):8.2f}")


if __name__ == "__main__":
  main()
