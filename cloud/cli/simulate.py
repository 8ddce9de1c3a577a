"""``aisynergy simulate``: federated-training simulation (DESIGN §5, ``seeds/002``; :mod:`cloud.simulation`).

    aisynergy simulate quality --participants 1000 --alpha 0.5 --rounds 50 --fraction 0.1 [--strategy fedprox
        --strategy-param mu=0.01] [--dropout 0.2] [--seed 0] [--json quality.json]
    aisynergy simulate efficiency --params 100M [--participants 2] [--rounds 3] [--local-steps 5] [--batch 32]
        [--bandwidth-mbps 1000,100] [--latency-ms 5,20] [--slowdown 1,1.5] [--json efficiency.json]

``quality``: a small MLP on scikit-learn's digits dealt out non-IID (Dirichlet over labels) to many virtual
participants; accuracy and loss of the global model on held-out images after every round. ``efficiency``: an MLP of
the requested size trained by a few participants; per participant the total time, compute utilisation, communication
share and serialisation share (the seed's columns). Compute, (de)serialisation and aggregation are measured on this
machine; the links are simulated. One process, numpy only (the ``[hub]`` extra); ``quality`` also needs scikit-learn
(the ``[train]`` extra) for its data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from cloud.simulation.common import STRATEGY_NAMES, MissingExtra, SimulationError
from cloud.simulation.efficiency import EfficiencyConfig, EfficiencyRound, parse_count, run_efficiency, size_mlp
from cloud.simulation.mlp import param_count
from cloud.simulation.quality import QualityConfig, QualityRound, load_digits, run_quality


class _Count(click.ParamType):
    name = "COUNT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_count(value)
        except SimulationError as exc:
            self.fail(str(exc), param, ctx)


class Floats(click.ParamType):
    """``1000`` or ``1000,100``: one value for every participant, or one each."""

    name = "X[,X...]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[float, ...]:
        if isinstance(value, tuple):
            return value
        try:
            return tuple(float(part) for part in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r} is not a number or a comma-separated list of numbers", param, ctx)


def parse_strategy_params(pairs: tuple[str, ...]) -> dict[str, float]:
    params: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            if not sep or not key:
                raise ValueError
            params[key.strip()] = float(value)
        except ValueError:
            raise click.BadParameter(f"{pair!r} is not KEY=NUMBER", param_hint="--strategy-param") from None
    return params


def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    click.echo(f"wrote {path}")


@click.group()
def simulate() -> None:
    """Simulate federated training: model quality (many participants) or computing efficiency (a large model)."""


@simulate.command("quality")
@click.option("--participants", default=100, show_default=True, type=click.IntRange(min=1),
              help="virtual participants (each gets at least one training image: at most 1,347)")
@click.option("--alpha", default=0.5, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Dirichlet concentration over labels (small: each participant sees few labels)")
@click.option("--rounds", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--fraction", default=0.1, show_default=True, type=click.FloatRange(min=0, max=1, min_open=True),
              help="share of the participants sampled each round")
@click.option("--local-epochs", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--batch", default=10, show_default=True, type=click.IntRange(min=1), help="local mini-batch size")
@click.option("--lr", default=0.1, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="local SGD learning rate")
@click.option("--hidden", default=32, show_default=True, type=click.IntRange(min=0),
              help="hidden units of the MLP (0: softmax regression)")
@click.option("--strategy", default="fedavg", show_default=True, type=click.Choice(STRATEGY_NAMES),
              help="aggregation strategy (interfaces.aggregation)")
@click.option("--strategy-param", "strategy_params", multiple=True, metavar="KEY=NUMBER",
              help="a strategy parameter (repeatable): mu=0.01 (fedprox), eta=0.01 (fedadam), beta=0.1 (trimmed_mean)")
@click.option("--dropout", default=0.0, show_default=True, type=click.FloatRange(min=0, max=1, max_open=True),
              help="share of the sampled participants that fail each round (the round closes with the others)")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write every number to this file")
def quality_cmd(participants: int, alpha: float, rounds: int, fraction: float, local_epochs: int, batch: int,
                lr: float, hidden: int, strategy: str, strategy_params: tuple[str, ...], dropout: float, seed: int,
                json_path: Path | None) -> None:
    """Federated training of a small MLP on the digits images, non-IID over many participants: accuracy per round."""
    cfg = QualityConfig(participants=participants, alpha=alpha, rounds=rounds, fraction=fraction,
                            local_epochs=local_epochs, batch=batch, lr=lr, hidden=hidden, strategy=strategy,
                            strategy_params=parse_strategy_params(strategy_params), dropout=dropout, seed=seed)
    try:
        data = load_digits()
    except MissingExtra as exc:
        raise click.ClickException(str(exc)) from None
    if participants > len(data.y_train):
        raise click.BadParameter(f"{participants} participants but only {len(data.y_train)} training images",
                                 param_hint="--participants")
    header_done = False

    def on_round(entry: QualityRound) -> None:
        nonlocal header_done
        if not header_done:
            click.echo(f"{'round':>5}  {'accuracy':>8}  {'loss':>6}  {'used/sampled':>12}  {'train loss':>10}")
            header_done = True
        used = f"{entry.used}/{entry.sampled}" if entry.round else "-"
        train = f"{entry.train_loss:.4f}" if entry.train_loss is not None else "-"
        click.echo(f"{entry.round:>5}  {100 * entry.accuracy:>7.2f}%  {entry.loss:>6.4f}  {used:>12}  {train:>10}")

    sizes = [64, *([hidden] if hidden else []), 10]
    click.echo(f"digits: {len(data.y_train)} training / {len(data.y_test)} test images; {participants} participants, "
               f"Dirichlet alpha {alpha:g}; model {'-'.join(map(str, sizes))} ({param_count(sizes):,} parameters); "
               f"{strategy}; {max(1, round(fraction * participants))} sampled per round"
               + (f", {100 * dropout:g}% of them fail" if dropout else ""))
    try:
        result = run_quality(cfg, data=data, on_round=on_round)
    except SimulationError as exc:
        raise click.UsageError(str(exc)) from None
    d = result.data
    click.echo(f"participants hold {d['participant_sizes_min']}-{d['participant_sizes_max']} images each, "
               f"label skew {d['label_skew']:.2f} (mean share of a participant's most common label)")
    click.echo(f"best accuracy {100 * result.best_accuracy:.2f}% (round {result.best_round}); "
               f"final {100 * result.rounds[-1].accuracy:.2f}%; {result.seconds:.2f} s")
    write_json(json_path, result.to_json())


@simulate.command("efficiency")
@click.option("--params", "params", default="10M", show_default=True, type=_Count(),
              help="model size in parameters: 100000, 100k, 10M, 1.5M")
@click.option("--participants", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--local-steps", default=5, show_default=True, type=click.IntRange(min=1),
              help="SGD steps per participant per round")
@click.option("--batch", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--depth", default=4, show_default=True, type=click.IntRange(min=1), help="hidden layers of the MLP")
@click.option("--lr", default=0.01, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--bandwidth-mbps", type=Floats(), default=None,
              help="link bandwidth in Mbit/s, one value or one per participant  [default: 1000,100; for n "
                   "participants 1000 down to 100, geometrically]")
@click.option("--latency-ms", type=Floats(), default=None,
              help="link latency in ms, one value or one per participant  [default: 5,20; for n participants "
                   "5 up to 20, evenly]")
@click.option("--slowdown", type=Floats(), default=None,
              help="compute slowdown, one value or one per participant (1.5: 1.5x slower than this machine)"
                   "  [default: 1]")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write every number to this file")
def efficiency_cmd(params: int, participants: int, rounds: int, local_steps: int, batch: int, depth: int, lr: float,
                   bandwidth_mbps: tuple[float, ...] | None, latency_ms: tuple[float, ...] | None,
                   slowdown: tuple[float, ...] | None, seed: int, json_path: Path | None) -> None:
    """Federated rounds of an MLP of --params parameters: where each participant's time goes (seed's columns)."""
    cfg = EfficiencyConfig(params=params, participants=participants, rounds=rounds, local_steps=local_steps,
                               batch=batch, depth=depth, lr=lr, bandwidth_mbps=bandwidth_mbps, latency_ms=latency_ms,
                               slowdown=slowdown, seed=seed)
    try:
        links, slowdowns = cfg.check()
        size_mlp(params, depth)
    except SimulationError as exc:
        raise click.UsageError(str(exc)) from None

    def on_model(sizes: list[int], count: int) -> None:
        click.echo(f"model: MLP {'-'.join(map(str, sizes))}, {count:,} parameters (requested {params:,}, "
                   f"{100 * (count - params) / params:+.3f}%), {count * 4 / 1e6:,.1f} MB as float32")
        click.echo("links (simulated): " + "; ".join(
            f"client{i + 1} {lk.bandwidth_mbps:g} Mbit/s {lk.latency_ms:g} ms, slowdown {s:g}"
            for i, (lk, s) in enumerate(zip(links, slowdowns, strict=True))))
        click.echo(f"{rounds} rounds x {local_steps} SGD steps at batch {batch}; FedAvg")

    def on_round(entry: EfficiencyRound) -> None:
        click.echo(f"round {entry.round}: {entry.duration_s:.2f} s; "
                   f"server deserialise {entry.server_deserialise_s:.3f} s, "
                   f"aggregate {entry.aggregate_s:.3f} s, serialise {entry.server_serialise_s:.3f} s")

    result = run_efficiency(cfg, on_round=on_round, on_model=on_model)
    click.echo(f"{'participant':<11}  {'total time (s)':>14}  {'compute util.':>13}  {'communication':>13}  "
               f"{'serialisation':>13}  {'waiting':>7}")
    for p in result.participants:
        click.echo(f"{p.name:<11}  {p.total_s:>14.2f}  {p.compute_utilisation_pct:>12.2f}%  "
                   f"{p.communication_pct:>12.2f}%  "
                   f"{p.serialisation_pct:>12.3f}%  {p.waiting_pct:>6.2f}%")
    s = result.server
    click.echo(f"server: aggregate {s['aggregate_s']:.3f} s, deserialise {s['deserialise_s']:.3f} s, "
               f"serialise {s['serialise_s']:.3f} s (totals); update {result.update_bytes:,} bytes")
    click.echo(f"measured: compute, (de)serialisation, aggregation; simulated: the links. "
               f"wall {result.wall_s:.1f} s, peak RSS {result.peak_rss_mb:,.0f} MB")
    write_json(json_path, result.to_json())
