"""Reproduce the theoretical figures of Gruslys et al. (2016) with fxplan.bptt's solvers.

    python scripts/bptt_figures.py [--t 1000] [--out docs/img]

Writes docs/img/bptt_policies.png (Figures 2a, 5a, 5b: forward operations per time step against
sequence length for several memory sizes), docs/img/bptt_compare.png (Figure 6: HSM, ISM and MSM at
equal memory) and docs/img/bptt_chen.png (Figure 7: MSM against Chen's sqrt(t) schedule), and prints
the headline numbers. Needs matplotlib (``pip install matplotlib``, the ``report`` extra).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

from fxplan.bptt import optimal_cost, solve

MEMS = (10, 50, 100, 500, 1000)
COLORS = ("red", "green", "blue", "violet", "cyan")
CMD = "python scripts/bptt_figures.py"


def per_step(C: np.ndarray, T: int, m: int) -> np.ndarray:
    t = np.arange(1, T + 1)
    return C[1 : T + 1, min(m, C.shape[1] - 1)] / t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, default=1000, help="longest sequence length (default 1000)")
    ap.add_argument("--alpha", type=int, default=5, help="internal/hidden state size ratio (default 5)")
    ap.add_argument("--out", default="docs/img", help="folder for the PNG files")
    args = ap.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bptt_figures.py needs matplotlib: pip install matplotlib (or pip install -e .[report])",
              file=sys.stderr)
        return 2
    T, alpha = args.t, args.alpha
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t = np.arange(1, T + 1)

    # Headline (section 3.2): ISM with 50 internal states for 1000 steps.
    c = optimal_cost("ism", 1000, 50)
    print(f"ISM t=1000 m=50: {c} forward ops; memory -{1 - 50 / 1000:.0%}; time per iteration "
          f"+{(c + 2000) / 3000 - 1:.1%} (a backward = 2 forwards)")

    # Figures 2a / 5a / 5b.
    tic = time.perf_counter()
    hsm = solve("hsm", T, max(MEMS)).C
    ism = solve("ism", T, max(MEMS)).C
    msm = solve("msm", T, alpha * max(MEMS), alpha=alpha).C
    print(f"solved HSM, ISM (m <= {max(MEMS)}) and MSM (m <= {alpha * max(MEMS)}) for t <= {T} "
          f"in {time.perf_counter() - tic:.1f} s")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for ax, C, title, scale, unit in (
        (axes[0], hsm, "BPTT-HSM (Fig. 2a)", 1, "hidden states"),
        (axes[1], ism, "BPTT-ISM (Fig. 5a)", 1, "internal states"),
        (axes[2], msm, f"BPTT-MSM, alpha={alpha} (Fig. 5b)", alpha, "internal states"),
    ):
        for m, col in zip(MEMS, COLORS):
            ax.plot(t, per_step(C, T, m * scale), color=col, label=f"{m} {unit}")
        ax.axhline(1.0, color="grey", lw=1, label="plain BPTT")
        ax.set_title(title)
        ax.set_xlabel("sequence length t")
        ax.set_ylim(0, 8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("forward operations per time step")
    fig.suptitle(f"Optimal cost per time step ({CMD})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "bptt_policies.png", dpi=110)
    for m in MEMS:
        print(f"t={T} m={m}: HSM {hsm[T, m] / T:.3f}  ISM {ism[T, m] / T:.3f}  "
              f"MSM(alpha={alpha}, {m} internal) {msm[T, alpha * m] / T:.3f} forward ops/step")

    # Figure 6: equal memory 10 alpha and 20 alpha hidden-state units.
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, k in zip(axes, (10, 20)):
        ax.plot(t, per_step(hsm, T, k * alpha), color="red", label=f"HSM, {k * alpha} hidden states")
        ax.plot(t, per_step(ism, T, k), color="green", label=f"ISM, {k} internal states")
        ax.plot(t, per_step(msm, T, k * alpha), color="blue", label=f"MSM, {k * alpha} units")
        ax.set_title(f"memory {k} x alpha (alpha={alpha}) (Fig. 6)")
        ax.set_xlabel("sequence length t")
        ax.set_ylabel("forward operations per time step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        cross = next((i + 1 for i in range(T) if hsm[i + 1, k * alpha] < ism[i + 1, k]), None)
        print(f"memory {k}*alpha: HSM beats ISM from t={cross}; at t={T}: HSM {hsm[T, k * alpha]}, "
              f"ISM {ism[T, k]}, MSM {msm[T, k * alpha]} forward ops")
    fig.suptitle(CMD, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "bptt_compare.png", dpi=110)

    # Figure 7: against Chen's sqrt(t) (sqrt(t) hidden + sqrt(t) internal states without their inputs).
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for beta, col in zip((2, 5, 10), ("red", "green", "blue")):
        a = beta + 1
        chen_mem = np.sqrt(t) * (1 + beta)
        M = int(math.ceil(chen_mem[-1])) + 1
        C = solve("msm", T, M, alpha=a, beta=beta).C
        # Least memory for which MSM costs at most 2 forwards per step (Chen's sqrt(t) cost).
        ok = C[1 : T + 1, 1:] <= 2 * t[:, None]
        least = np.where(ok.any(axis=1), ok.argmax(axis=1) + 1, M)
        axes[0].plot(t, least / chen_mem, color=col, label=f"beta={beta}")
        axes[1].plot(t, C[t, np.ceil(chen_mem).astype(int)] / t, color=col, label=f"beta={beta}")
        chen = [solve("chen_sqrt", n, alpha=a, beta=beta) for n in (100, 400, 900)]
        print(f"beta={beta}: MSM needs {least[-1]} units for cost <= 2t at t={T} "
              f"({least[-1] / chen_mem[-1]:.2f} of sqrt(t)(1+beta)); Chen sqrt(t) at t=100/400/900 costs "
              f"{[p.cost() for p in chen]} with {[p.m for p in chen]} units")
    axes[0].axhline(1, color="grey", lw=1)
    axes[0].set_title("MSM memory for cost 2 / Chen's sqrt(t)(1+beta) (Fig. 7 left)")
    axes[0].set_ylabel("memory ratio (< 1 saves memory)")
    axes[1].axhline(2, color="grey", lw=1, label="Chen sqrt(t): 2")
    axes[1].set_title("MSM cost at memory sqrt(t)(1+beta) (Fig. 7 right)")
    axes[1].set_ylabel("forward operations per time step")
    for ax in axes:
        ax.set_xlabel("sequence length t")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(CMD, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "bptt_chen.png", dpi=110)
    print(f"wrote {out}/bptt_policies.png, bptt_compare.png, bptt_chen.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
