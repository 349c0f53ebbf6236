"""PNG figures of a run: the loss curve and the cross-attention map.

matplotlib with the non-interactive Agg backend (no display needed); figures
are closed after saving so long sessions do not accumulate them. A figure's file
appears whole or not at all (`interrupts.written_whole`: a Ctrl-C midway).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxformer.cli.interrupts import written_whole


def _pyplot():
    import matplotlib  # noqa: PLC0415 (plotting is optional at import time)

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def loss_curve(history: Sequence[dict], path: str, *, title: str = "training loss",
               evals: Sequence[dict] = ()) -> None:
    """Plot `loss` (log scale) and `token_accuracy` against `step` from per-step records,
    and the held-out `eval_loss` of `evals` records as points."""
    if not history:
        raise ValueError("history is empty: nothing to plot")
    plt = _pyplot()
    steps = np.array([r["step"] for r in history])
    fig, ax_loss = plt.subplots(figsize=(7, 4))
    ax_loss.plot(steps, [r["loss"] for r in history], color="tab:blue", lw=1, label="train")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-",
                     color="tab:green", ms=4, lw=1, label="held-out")
        ax_loss.legend(loc="upper center")
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (non-PAD tokens)", color="tab:blue")
    ax_acc = ax_loss.twinx()
    ax_acc.plot(steps, [r["token_accuracy"] for r in history], color="tab:orange", lw=1)
    ax_acc.set_ylabel("token accuracy (teacher forced)", color="tab:orange")
    ax_acc.set_ylim(0, 1.02)
    ax_loss.set_title(title)
    fig.tight_layout()
    with written_whole(path) as part:
        fig.savefig(part, dpi=100)
    plt.close(fig)


def attention_maps(maps: dict, src_tokens: Sequence[int], tgt_tokens: Sequence[int],
                   path: str, *, title: str = "decoder cross-attention") -> None:
    """One panel per layer: head-averaged weights (T, S), targets down, sources across.

    `maps` is {"decoder/layers_0/cross_attn": (T, S) array, ...}; the tick
    labels are the token ids, so a copy model shows a diagonal.
    """
    if not maps:
        raise ValueError("maps is empty: nothing to plot")
    plt = _pyplot()
    names = sorted(maps)
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names) + 0.8, 3.8),
                             squeeze=False)
    for ax, name in zip(axes[0], names):
        image = ax.imshow(np.asarray(maps[name]), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_title(name.replace("decoder/", "").replace("/cross_attn", ""), fontsize=9)
        ax.set_xticks(range(len(src_tokens)), [str(t) for t in src_tokens], fontsize=7)
        ax.set_yticks(range(len(tgt_tokens)), [str(t) for t in tgt_tokens], fontsize=7)
        ax.set_xlabel("source token")
    axes[0][0].set_ylabel("decoder input token")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    fig.suptitle(title)
    with written_whole(path) as part:
        fig.savefig(part, dpi=100)
    plt.close(fig)
