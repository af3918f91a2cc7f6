"""PNG plots of benchmark results: the KV memory breakdown (Fig. 2) and latency against rate
(Fig. 12)."""

from __future__ import annotations

from services.scheduler.kv_accounting import KINDS

COLORS = {
    "token_states": "#2b8a3e",
    "reserved": "#f08c00",
    "internal_fragmentation": "#c92a2a",
    "external_fragmentation": "#862e9c",
    "free": "#ced4da",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_memory(policies: dict[str, dict[str, float]], path: str, title: str) -> None:
    """Stacked bars, one per policy, of the KV pool's fractions by kind."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(policies)
    bottoms = [0.0] * len(names)
    for kind in KINDS:
        values = [100 * policies[n].get(kind, 0.0) for n in names]
        ax.bar(names, values, bottom=bottoms, color=COLORS[kind], label=kind.replace("_", " "))
        for i, v in enumerate(values):
            if kind == "token_states":
                ax.text(i, v / 2, f"{v:.1f}%", ha="center", va="center", color="white")
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_ylabel("% of KV cache slots")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_latency(
    curves: dict[str, list[tuple[float, float]]], path: str, title: str, bound: float
) -> None:
    """Normalized latency (s/token) against request rate, one curve per policy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, points in curves.items():
        rates, latencies = zip(*sorted(points))
        ax.plot(rates, latencies, marker="o", label=name)
    ax.axhline(bound, color="grey", linestyle=":", label=f"bound {bound:g} s/token")
    top = max(lat for points in curves.values() for _, lat in points)
    ax.set_ylim(0, min(top * 1.05, 10 * bound))
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
