"""``aisynergy experiment``: the seed's federated experiment, measured (``seeds/000``; :mod:`cloud.simulation.experiment`,
:mod:`cloud.simulation.sites`).

    aisynergy experiment sites [--sites 5] [--rounds 20] [--alpha 0.5] [--model cnn|torch-cnn|resnet] [--algorithm DIR]
        [--config JSON] [--strategy fedavg] [--compression none] [--link-mbps 100] [--latency-ms 20] [--seed 0]
        [--data-dir DIR] [--json FILE]

    aisynergy experiment fl [--parties 5] [--alpha 0.5] [--rounds 200] [--local-epochs 1] [--batch 10] [--lr 0.1]
        [--hidden 64] [--strategy fedavg] [--dp-epsilon 8 [--dp-delta 1e-5] [--clip-norm 0.5] [--dp-batch 256]
        [--dp-lr 2]] [--bandwidth-mbps 1000,...] [--latency-ms 5,...] [--seed 0] [--repeats 1] [--json FILE]

The digits MLP trained three ways (four with ``--dp-epsilon``) on the same non-IID split and scored on the same
held-out images: each party alone, federated, centralised (and federated with DP-SGD on every party); then the
seed's comparison (federated − local-only, centralised − federated, in points) and the largest share of the time a
party spends communicating over its simulated link. One process, numpy only; needs scikit-learn for the data.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import numpy as np

from cloud.cli.simulate import Floats, parse_strategy_params, write_json
from cloud.simulation import experiment as ex
from cloud.simulation.common import STRATEGY_NAMES, MissingExtra, SimulationError, build_strategy, machine
from cloud.simulation.mlp import param_count
from cloud.simulation.quality import load_digits


@click.group()
def experiment() -> None:
    """Experiments that measure the seed's claims (seeds/000): federated vs local-only vs centralised."""


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _points(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def _report(result: ex.ExperimentResult) -> None:
    cfg, c = result.config, result.comparison
    local_mean = result.local["mean"]
    fed, cen, dp = result.federated.accuracy, result.centralised["accuracy"], result.federated_dp
    click.echo("local-only, per party: " + ", ".join(
        f"party{k + 1} {_pct(a)}" for k, a in enumerate(result.local["accuracies"])))
    if dp is not None and dp.dp:
        for plan in dp.dp:
            click.echo(f"DP party{plan.party + 1}: {plan.examples} images, q {plan.sample_rate:.4f}, "
                       f"{plan.steps} steps ({plan.steps_per_round} a round), sigma {plan.noise_multiplier:.4f}, "
                       f"epsilon spent {plan.epsilon:.4f} (target {cfg['dp_epsilon']:g}, delta {plan.delta:g})")
    rows = [(f"local-only (mean of {cfg['parties']})", local_mean),
            (f"federated ({cfg['strategy']})", fed),
            ("centralised (pooled)", cen),
            (f"federated + DP (eps {cfg['dp_epsilon']:g})" if dp is not None else "federated + DP", None
             if dp is None else dp.accuracy)]
    click.echo("")
    click.echo(f"{'arm':<28}  {'test acc.':>9}  {'vs local-only':>13}  {'vs centralised':>14}")
    for name, acc in rows:
        vs_local = None if acc is None or name.startswith("local") else 100 * (acc - local_mean)
        vs_central = None if acc is None or name.startswith("centralised") else 100 * (acc - cen)
        click.echo(f"{name:<28}  {_pct(acc):>9}  {_points(vs_local):>13}  {_points(vs_central):>14}")
    click.echo("")
    click.echo(f"federated - local-only:  {c['federated_minus_local_points']:+.2f} points "
               f"(seed 000: +{ex.SEED_GAIN_OVER_LOCAL_POINTS:g})")
    click.echo(f"centralised - federated: {c['centralised_minus_federated_points']:+.2f} points "
               f"(seed 000: {ex.SEED_GAP_TO_CENTRAL_POINTS:g})")
    if dp is not None:
        click.echo(f"centralised - federated+DP: {c['centralised_minus_federated_dp_points']:+.2f} points "
                   f"(target <= {ex.DP_GAP_TO_CENTRAL_POINTS:g})")
    parts = result.federated.parties
    click.echo(f"communication: {c['communication_pct_max']:.1f}% of the federated run's time at most "
               f"({', '.join(f'{p.name} {p.communication_pct:.1f}%' for p in parts)}; seed 000: "
               f"< {ex.SEED_COMMUNICATION_PCT:g}%); T {result.federated.total_s:.3f} s on the computed clock, "
               f"update {result.federated.update_bytes:,} bytes (safetensors)")
    for target, met in c["met"].items():
        click.echo(f"  [{'met' if met else 'MISSED'}] {target}")


@experiment.command("fl")
@click.option("--parties", default=5, show_default=True, type=click.IntRange(min=1),
              help="parties (each gets about 1,347 / parties training images)")
@click.option("--alpha", default=0.5, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Dirichlet concentration over labels (small: each party sees few labels)")
@click.option("--rounds", default=ex.ExperimentConfig.rounds, show_default=True, type=click.IntRange(min=1))
@click.option("--local-epochs", default=ex.ExperimentConfig.local_epochs, show_default=True,
              type=click.IntRange(min=1), help="epochs a party trains each round (local-only and centralised train "
                                               "rounds x local-epochs epochs)")
@click.option("--batch", default=ex.ExperimentConfig.batch, show_default=True, type=click.IntRange(min=1))
@click.option("--lr", default=ex.ExperimentConfig.lr, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="SGD learning rate (every arm but the DP one)")
@click.option("--hidden", default=ex.ExperimentConfig.hidden, show_default=True, type=click.IntRange(min=0),
              help="hidden units of the MLP (0: softmax regression)")
@click.option("--strategy", default="fedavg", show_default=True, type=click.Choice(STRATEGY_NAMES),
              help="aggregation strategy (interfaces.aggregation)")
@click.option("--strategy-param", "strategy_params", multiple=True, metavar="KEY=NUMBER",
              help="a strategy parameter (repeatable): mu=0.01 (fedprox), eta=0.01 (fedadam), beta=0.1 (trimmed_mean)")
@click.option("--dp-epsilon", type=click.FloatRange(min=0, min_open=True), default=None,
              help="also run federated with DP-SGD on every party, each party's epsilon over the task at most this")
@click.option("--dp-delta", default=ex.ExperimentConfig.dp_delta, show_default=True,
              type=click.FloatRange(min=0, max=1, min_open=True, max_open=True))
@click.option("--clip-norm", default=ex.ExperimentConfig.clip_norm, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="DP-SGD per-example L2 clipping norm")
@click.option("--dp-batch", default=ex.ExperimentConfig.dp_batch, show_default=True, type=click.IntRange(min=1),
              help="DP-SGD expected (Poisson) batch size; sample rate q = dp-batch / party images")
@click.option("--dp-lr", default=ex.ExperimentConfig.dp_lr, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="DP-SGD learning rate")
@click.option("--bandwidth-mbps", type=Floats(), default=None,
              help="link bandwidth in Mbit/s, one value or one per party  [default: 1000 ... 100]")
@click.option("--latency-ms", type=Floats(), default=None,
              help="link latency in ms, one value or one per party  [default: 5 ... 20]")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(min=1),
              help="run seeds seed, seed+1, ...: each run's table, then mean, sd, min and max")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write every number to this file")
def fl_cmd(parties: int, alpha: float, rounds: int, local_epochs: int, batch: int, lr: float, hidden: int,
           strategy: str, strategy_params: tuple[str, ...], dp_epsilon: float | None, dp_delta: float,
           clip_norm: float, dp_batch: int, dp_lr: float, bandwidth_mbps: tuple[float, ...] | None,
           latency_ms: tuple[float, ...] | None, seed: int, repeats: int, json_path: Path | None) -> None:
    """Local-only vs federated vs centralised (vs federated with DP-SGD) on the digits, non-IID over the parties."""
    cfg = ex.ExperimentConfig(parties=parties, alpha=alpha, rounds=rounds, local_epochs=local_epochs, batch=batch,
                              lr=lr, hidden=hidden, strategy=strategy, strategy_params=parse_strategy_params(strategy_params),
                              dp_epsilon=dp_epsilon, dp_delta=dp_delta, clip_norm=clip_norm, dp_batch=dp_batch,
                              dp_lr=dp_lr, bandwidth_mbps=bandwidth_mbps, latency_ms=latency_ms, seed=seed)
    try:
        cfg.check()
        build_strategy(strategy, cfg.strategy_params)
    except SimulationError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        data = load_digits()
    except MissingExtra as exc:
        raise click.ClickException(str(exc)) from None
    if parties > len(data.y_train):
        raise click.BadParameter(f"{parties} parties but only {len(data.y_train)} training images",
                                 param_hint="--parties")
    sizes = [64, *([hidden] if hidden else []), 10]
    click.echo(f"digits: {len(data.y_train)} training / {len(data.y_test)} test images; {parties} parties, Dirichlet "
               f"alpha {alpha:g}; model {'MLP' if hidden else 'softmax regression'} {'-'.join(map(str, sizes))} "
               f"({param_count(sizes):,} parameters); {rounds} rounds x {local_epochs} local epochs "
               f"(local-only and centralised: {cfg.total_epochs} epochs), batch {batch}, lr {lr:g}; {strategy}"
               + (f"; DP-SGD eps {dp_epsilon:g} delta {dp_delta:g}, clip {clip_norm:g}, expected batch {dp_batch}, "
                  f"lr {dp_lr:g}" if dp_epsilon is not None else ""))
    results: list[ex.ExperimentResult] = []
    for run in range(repeats):
        run_cfg = replace(cfg, seed=seed + run)
        try:
            result = ex.run_experiment(run_cfg, data=data)
        except SimulationError as exc:
            raise click.UsageError(str(exc)) from None
        results.append(result)
        click.echo("")
        click.echo(f"seed {run_cfg.seed}: parties hold {result.data['party_sizes']} images, label skew "
                   f"{result.data['label_skew']:.2f} (mean share of a party's most common label); "
                   f"{result.wall_s:.1f} s")
        _report(result)
    payload: dict[str, Any]
    if repeats == 1:
        payload = results[0].to_json()
    else:
        summary = ex.summarise(results)
        click.echo("")
        click.echo(f"over {repeats} seeds ({seed}..{seed + repeats - 1}): mean, sd [min, max]")
        for name in ex.SUMMARY_FIELDS:
            if name in summary:
                s = summary[name]
                scale, unit = (100, "%") if name in ("local_only_mean", "federated", "centralised",
                                                     "federated_dp") else (1, "")
                click.echo(f"  {name:<38} {scale * s['mean']:7.2f}{unit} sd {scale * s['sd']:.2f} "
                           f"[{scale * s['min']:.2f}, {scale * s['max']:.2f}]")
        for target, count in summary["met"].items():
            click.echo(f"  {count}/{repeats} runs met: {target}")
        payload = {"kind": "experiment-fl-repeats", "summary": summary, "runs": [r.to_json() for r in results],
                   "machine": machine()}
    write_json(json_path, payload)


_EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "algorithms"
_MODELS = {"cnn": "numpy_cnn", "torch-cnn": "torch_cnn", "resnet": "torch_resnet"}


@experiment.command("sites")
@click.option("--sites", default=5, show_default=True, type=click.IntRange(2, 32), help="site processes (edge agents) on this machine")
@click.option("--rounds", default=20, show_default=True, type=click.IntRange(1, 1000))
@click.option("--alpha", default=0.5, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Dirichlet concentration over labels of the sites' shards (small: each site sees few labels)")
@click.option("--model", default="cnn", show_default=True, type=click.Choice(sorted(_MODELS)),
              help="the example algorithm: cnn (numpy, 1,370 parameters), torch-cnn (the same network in PyTorch), "
                   "resnet (PyTorch, a ResNet-18 of 11.2M parameters on digits upscaled to 16x16)")
@click.option("--algorithm", "algorithm_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="another algorithm package folder (its datasets: train, test) instead of --model's")
@click.option("--config", "config_json", default=None, metavar="JSON", help='the algorithm\'s configuration  [default: {"epochs": 1}]')
@click.option("--strategy", default="fedavg", show_default=True, type=click.Choice(STRATEGY_NAMES))
@click.option("--compression", default="none", show_default=True, type=click.Choice(["none", "fp16", "int8", "topk"]))
@click.option("--link-mbps", default=100.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="the declared link of every site, in Mbit/s: the bytes measured are timed on it")
@click.option("--latency-ms", default=20.0, show_default=True, type=click.FloatRange(0, 10_000, max_open=True), help="each way, per round")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--dp-epsilon", type=click.FloatRange(0, 1000, min_open=True, max_open=True), default=None,
              help="the federated arm by DP-SGD on each site, its noise calibrated so that every site stays within this epsilon")
@click.option("--dp-delta", default=1e-5, show_default=True, type=click.FloatRange(0, 0.01, min_open=True, max_open=True))
@click.option("--dp-clip-norm", default=1.0, show_default=True, type=click.FloatRange(0, 1000, min_open=True, max_open=True),
              help="DP-SGD: each example's gradient clipped to this L2 norm")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="where the stack, the sites and the data live (default: a temporary folder, removed after)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="write every number to this file")
def sites_cmd(sites: int, rounds: int, alpha: float, model: str, algorithm_dir: Path | None, config_json: str | None, strategy: str,
              compression: str, link_mbps: float, latency_ms: float, seed: int, dp_epsilon: float | None, dp_delta: float, dp_clip_norm: float,
              data_dir: Path | None, json_path: Path | None) -> None:
    """The seed's demo on real processes: a hub and SITES edge agents, each keeping a non-IID shard of the digits, train
    one network with a federated_training task; the same fit calls on each site alone and on the pooled shards
    (training tasks) give the local-only and centralised arms. Prints the seed's comparison, the slowest site's
    communication share on the declared link and the bytes per round."""
    import json
    import shutil
    import tempfile

    from cloud.simulation.sites import SitesConfig, SitesExperiment

    algorithm = algorithm_dir or _EXAMPLES / _MODELS[model]
    if not (algorithm / "algorithm.json").is_file():
        raise click.UsageError(f"{algorithm} is no algorithm package folder (the examples are in a checkout of the project)")
    try:
        config = json.loads(config_json) if config_json is not None else {"epochs": 1}
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--config") from None
    if not isinstance(config, dict):
        raise click.BadParameter("a JSON object", param_hint="--config")
    cfg = SitesConfig(algorithm=algorithm.resolve(), sites=sites, rounds=rounds, alpha=alpha, config=config, strategy=strategy,
                      compression=compression, link_mbps=link_mbps, latency_ms=latency_ms, seed=seed, dp_epsilon=dp_epsilon, dp_delta=dp_delta,
                      dp_clip_norm=dp_clip_norm)  # fmt: skip
    scratch = None if data_dir is not None else Path(tempfile.mkdtemp(prefix="aisynergy-sites-"))
    where = (data_dir or scratch).resolve()  # type: ignore[union-attr]
    try:
        try:
            result = SitesExperiment(cfg, where, echo=click.echo).run()
        except SimulationError as exc:
            raise click.ClickException(str(exc)) from None
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    _report_sites(result)
    write_json(json_path, result.to_json())


def _report_sites(result: Any) -> None:
    c = result.comparison()
    click.echo("")
    dp = result.config.get("dp_epsilon") is not None
    click.echo(f"{'site':<8} {'images':>6} {'labels (most common)':<22} {'local-only':>10} {'fit s':>7} {'comm. s':>8} {'comm.':>6}"
               + (f" {'epsilon':>7}" if dp else ""))
    for s in result.sites:
        top = ", ".join(f"{k}:{n}" for k, n in sorted(s.labels.items(), key=lambda kv: -kv[1])[:3])
        spent = "" if not dp else f" {s.epsilon:>7.3f}" if s.epsilon is not None else f" {'-':>7}"
        click.echo(f"{s.name:<8} {s.examples:>6} {top:<22} {_pct(s.local_accuracy):>10} {s.fit_s:>7.2f} {s.communication_s:>8.2f} {s.communication_pct:>5.1f}%"
                   + spent)
    local, fed, cen = result.local_mean, result.federated_accuracy, result.centralised_accuracy
    click.echo("")
    click.echo(f"{'arm':<34}  {'test acc.':>9}  {'vs local-only':>13}  {'vs centralised':>14}")
    federated = f"federated ({result.config['strategy']}" + (f", DP-SGD eps {result.config['dp_epsilon']:g})" if dp else ")")
    for name, acc in ((f"local-only (mean of {len(result.sites)})", local), (federated, fed), ("centralised (pooled)", cen)):
        vs_local = None if acc is None or local is None or name.startswith("local") else 100 * (acc - local)
        vs_central = None if acc is None or cen is None or name.startswith("centralised") else 100 * (acc - cen)
        click.echo(f"{name:<34}  {_pct(acc):>9}  {_points(vs_local):>13}  {_points(vs_central):>14}")
    click.echo("")
    rounds = result.rounds
    round_s = [r["round_s"] for r in rounds]
    click.echo(f"bytes per round: {c['bytes_per_round']:,.0f} (down {np.mean([r.get('bytes_down', 0) for r in rounds]):,.0f}, "
               f"up {np.mean([r.get('bytes_up', 0) for r in rounds]):,.0f}; model {rounds[-1].get('model_bytes', 0):,.0f} bytes); "
               f"round time {np.median(round_s):.2f} s median, {max(round_s):.2f} s max")
    click.echo(f"communication: {c['communication_pct_slowest']:.1f}% of the slowest site's time ({c['slowest_site']}, "
               f"{result.config['link_mbps']:g} Mbit/s, {result.config['latency_ms']:g} ms each way)")
    click.echo(f"wall time: federated {result.wall_s['federated_s']:.1f} s, local-only and centralised {result.wall_s['local_and_centralised_s']:.1f} s, "
               f"all {result.wall_s['total_s']:.1f} s")
    for target, met in c["met"].items():
        click.echo(f"  [{'met' if met else 'MISSED'}] {target}")
