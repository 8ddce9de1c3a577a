"""``aisynergy conformance``: run the suite against a running system and write the reports."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command()
@click.option("--hub", "hub_url", required=False, help="the hub's base URL, e.g. http://127.0.0.1:8000 (the API is under /api/v1)")
@click.option("--broker", "broker_url", required=False, help="the broker agents use, mqtts://host:port")
@click.option("--token", envvar="AISYNERGY_CONFORMANCE_TOKEN", required=False, help="an admin bearer token")
@click.option("--operator-token", envvar="AISYNERGY_CONFORMANCE_OPERATOR_TOKEN", default=None, help="an operator token (role cases)")
@click.option("--viewer-token", envvar="AISYNERGY_CONFORMANCE_VIEWER_TOKEN", default=None, help="a viewer token (role cases)")
@click.option("--ca", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None, help="the CA that signed the broker's (and an https hub's) certificate; default: GET /ca.crt")
@click.option("--clause", "clauses", multiple=True, help="run only these clauses (glob, e.g. '8.1.*' or 7.2.d.3); repeatable")
@click.option("--max-wait", type=float, default=120.0, show_default=True, help="the longest a case waits for a documented timeout to pass")
@click.option("--junit", type=click.Path(dir_okay=False, path_type=Path), default=Path("conformance-junit.xml"), show_default=True)
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), default=Path("conformance-report.md"), show_default=True)
@click.option("--list", "list_only", is_flag=True, help="list the clauses and cases and exit")
@click.option("--coverage", is_flag=True, help="print the clause coverage table (Markdown) and exit")
def conformance(hub_url: str | None, broker_url: str | None, token: str | None, operator_token: str | None, viewer_token: str | None,
                ca: Path | None, clauses: tuple[str, ...], max_wait: float, junit: Path, report: Path, list_only: bool, coverage: bool) -> None:  # fmt: skip
    """Run the conformance suite (clauses of GB/T 45401.2 sections 6-8) against a running hub and broker.

    Exit status 0 when every selected case passed or was skipped, 1 when any failed."""
    import conformance.cases  # noqa: F401 - registers the cases
    from conformance.catalogue import CATALOGUE
    from conformance.hub import Target
    from conformance.report import by_clause, console_line, coverage_table, junit_xml, markdown, summary
    from conformance.runner import FAILING, REGISTRY, run_cases, select

    if coverage:
        click.echo(coverage_table())
        return
    chosen = select(REGISTRY, list(clauses))
    if list_only:
        for clause in CATALOGUE:
            mine = [c for c in chosen if c.clause == clause.id]
            if clauses and not mine:
                continue
            click.echo(f"{clause.label:12} {clause.title}" + ("" if clause.testable else f"  [not testable: {clause.reason}]"))
            for c in mine:
                click.echo(f"    {c.name}: {c.title}")
        return
    if not (hub_url and broker_url and token):
        raise click.UsageError("--hub, --broker and --token are required (or --list / --coverage)")
    if not chosen:
        raise click.UsageError(f"no case matches --clause {' '.join(clauses)}")
    try:
        target = Target(hub_url, broker_url, token, ca_path=ca, operator_token=operator_token, viewer_token=viewer_token, max_wait_s=max_wait)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(f"conformance run {target.run_id}: {len(chosen)} cases against {target.hub_url} / {broker_url}")
    results = run_cases(target, chosen, on_result=lambda r: click.echo(console_line(r)))
    from conformance.cases.common import sweep

    for problem in sweep(target):
        click.echo(f"clean-up: {problem}", err=True)
    verdicts = by_clause(results, selected={c.clause for c in chosen} if clauses else None)
    junit_xml(results, junit)
    markdown(results, verdicts, f"{hub_url} / {broker_url}", report)
    click.echo(summary(results, verdicts))
    click.echo(f"reports: {junit} {report}")
    sys.exit(1 if any(r.verdict in FAILING for r in results) else 0)
