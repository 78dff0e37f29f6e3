"""Overlays the loss and per-layer load ratio of several examples/train_moe.py runs.

    python -m benchmarks.plot_train_runs "aux loss=OUT1" "expert bias=OUT2" --out FILE.png

Each LABEL=DIR names a run's --out folder (its train_moe.json); the plot has the loss per step
and the max/mean tokens-per-expert ratio per step of every layer, one colour per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="LABEL=DIR")
    p.add_argument("--out", default="benchmarks/out/train_runs.png")
    a = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for i, run in enumerate(a.runs):
        label, _, folder = run.partition("=")
        records = json.loads((Path(folder) / "train_moe.json").read_text())["records"]
        ax1.plot([r["loss"] for r in records], color=f"C{i}", label=label)
        ratio = np.array([r["load_ratio"] for r in records])  # [steps, layers]
        for layer in range(ratio.shape[1]):
            ax2.plot(ratio[:, layer], color=f"C{i}", ls=("-", "--", ":")[layer % 3],
                     label=f"{label}, layer {layer}")
    ax1.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="loss")
    ax2.set(xlabel="step", ylabel="max / mean tokens per expert", title="load ratio")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=100)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
