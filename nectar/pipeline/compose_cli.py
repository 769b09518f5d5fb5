"""``nectar compare RUN_A RUN_B …`` and ``nectar ask RUN_A RUN_B "…"``: the commands over several runs'
composed states (nectar/comparison/compose.py, nectar/serving/ask.py), kept out of cli.py."""
from __future__ import annotations

import sys
from typing import Optional

import typer
from rich.console import Console

console = Console(stderr=True)


def _names(text: Optional[str]) -> list[str] | None:
    return [s.strip() for s in text.split(",") if s.strip()] if text else None


def compare_runs(run_dirs: list[str], rho: Optional[str], bytes_: Optional[str], systems: Optional[str],
                 out: Optional[str], positions: Optional[str]) -> None:
    """Compose the runs' states and score them against their concatenated documents (no Prefect: it
    fits closed-form states in seconds and trains nothing)."""
    from ..comparison.compose import compare_composed, labels, open_runs, plan_systems
    from ..comparison.inputs import CompareInputError, parse_bytes, parse_rhos

    try:  # fail fast, before any model loads
        plan_systems(_names(systems), _names(positions))
        ctxs = open_runs(run_dirs)
        rhos = list(dict.fromkeys(parse_rhos(rho) + parse_bytes(bytes_, ctxs[0].config.model.dtype)))
    except CompareInputError as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2)
    out = out or f"{ctxs[0].run.root.rstrip('/')}/compose/{'+'.join(labels(ctxs))}"
    try:
        result = compare_composed(run_dirs, out, _names(systems), rhos or None, _names(positions))
    except CompareInputError as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2)
    typer.echo(result["markdown"])
    typer.echo(f"{result['out'].rstrip('/')}/comparison.md")


def ask_runs(run_dirs: list[str], question: str, positions: str, max_new_tokens, temperature, seed, debug) -> None:
    """Answer from the runs' modules composed (streams), or refuse in one line."""
    from ..serving.ask import ask_composed
    from .errors import reported

    with reported(debug, lambda m: print(m, file=sys.stderr)):
        ask_composed(run_dirs, question, stream=lambda text: (sys.stdout.write(text), sys.stdout.flush()),
                     positions=positions, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    sys.stdout.write("\n")
