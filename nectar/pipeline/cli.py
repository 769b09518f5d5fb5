"""The `nectar` command line."""
from __future__ import annotations

import os
import sys

# Threads that spin-wait for work cost ~10x when other processes share the cores; set before torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from contextlib import contextmanager
from typing import Iterator, List, NoReturn, Optional

import typer
from rich.console import Console
from rich.table import Table

from .. import shutdown
from ..schemas.config import STAGES
from . import deploy as ops
from . import operations
from .errors import OrchestratorUnreachable, interrupted_line, reported, resume_command
from .prefect_api import check_environment_url

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="NECTAR: per-document modules that replace attention over a long document's KV cache.")
console = Console(stderr=True)


def _tqdm_progress(stage: str):
    from tqdm.auto import tqdm

    bar = {"b": None}

    def update(done: int, total: int) -> None:
        if bar["b"] is None:
            bar["b"] = tqdm(total=total, desc=stage, unit="item", file=sys.stderr, dynamic_ncols=True)
        bar["b"].total = total
        bar["b"].n = done
        bar["b"].refresh()
        if done >= total:
            bar["b"].close()

    return update


def _quiet_prefect(debug: bool = False) -> None:
    # Ephemeral mode is fine for a one-off run; keep Prefect's own logs at warning level, and off
    # the terminal unless --debug: a failed stage is reported in one line (the flow run's logs on a
    # server keep the traceback).
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    if not debug:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The ephemeral API server starts in a subprocess; on a busy 2-core machine it can take longer
    # than Prefect's default 20 s.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


@app.command()
def run(
    documents: Optional[List[str]] = typer.Argument(
        None, help="Path, fsspec URL or pydoc:<topic> (default: pydoc:naming; with --only on an existing "
                   "run, the run's). Several, a glob, a directory or a manifest (*.jsonl, *.yaml, *.manifest): "
                   "a corpus, one run each under --runs, finished ones skipped, failed ones retried."),
    preset: str = typer.Option("cpu", help="tiny | cpu | paper"),
    config: Optional[str] = typer.Option(None, "--config", help="YAML file of overrides."),
    regime: Optional[str] = typer.Option(None, help="regression | mixed | distill | cartridges | matching | recon_fit"),
    set_: list[str] = typer.Option([], "--set", help="Override, e.g. --set train.module.rho=0.05"),
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help="Run directory (default runs/<doc-id>/<run-id>)."),
    from_stage: Optional[str] = typer.Option(None, "--from", help="Re-run this stage and everything after it."),
    only_stage: Optional[str] = typer.Option(None, "--only", help="Re-run only this stage on existing inputs."),
    force: bool = typer.Option(False, "--force", help="Ignore the cache for every stage."),
    no_wait: bool = typer.Option(False, "--no-wait", help="If another process is writing the run directory, "
                                                          "exit at once (code 3) instead of waiting for it."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and Prefect's own logs."),
    runs: str = typer.Option("runs", "--runs", help="A corpus's run root: runs/<doc-id>/<run-id> each."),
    questions: Optional[str] = typer.Option(None, "--questions", help="JSONL of your own questions "
                                            "({\"question\": …, \"answer\": …} per line, answer optional): "
                                            "evaluate scores them as the split 'questions'."),
) -> None:
    """Run the pipeline for one document (or a corpus, one document after the other)."""
    _quiet_prefect(debug)
    from .corpus import is_corpus

    if questions:  # a path in the config: the evaluate stage's inputs take the file's digest
        import json

        if only_stage:  # --only re-runs a stage with the run's own configuration (run.json)
            console.print("[red]error:[/red] --questions needs --from evaluate, not --only (--only re-runs a "
                          "stage with the run's own configuration, which has no questions file)", soft_wrap=True)
            raise typer.Exit(2)
        set_ = [*set_, f"evaluate.questions={json.dumps(_checked_questions(questions))}"]
    if is_corpus(documents):
        return _run_corpus(list(documents or []), preset, config, list(set_), runs, debug,
                           dict(run_dir=run_dir, from_=from_stage, only=only_stage, force=force, regime=regime))
    document = documents[0] if documents else None
    with _stoppable(debug) as resume:
        # Everything a user can get wrong is checked here, before Prefect starts (the core's first step).
        from ..orchestration import plan_document, run_lock
        from ..schemas.presets import load_config

        cfg = load_config(preset, config, regime, set_)
        request = plan_document(document, cfg, run_dir, from_stage, only_stage, force)
        resume.root = request.run.root
        from .prefect_api import prefect_api  # after _quiet_prefect: Prefect reads its settings on import

        # The lock before the flow: --no-wait exits at once, before a flow run is made.
        with prefect_api(), run_lock(request.run.root, wait=not no_wait, notify=_notice):
            from . import flows

            flows.CONSOLE_PROGRESS, flows.CONSOLE_NOTICE = _tqdm_progress, _notice
            result = flows.nectar_pipeline(
                document=request.document, preset=preset, config_file=config, overrides=list(set_),
                run_dir=request.run.root, from_stage=from_stage, only_stage=only_stage, force=force, regime=regime)
        _print_status(result["run_dir"])  # reads every output byte: Ctrl-C stops it too
        typer.echo(result["run_dir"])


def _run_corpus(documents: list[str], preset: str, config: Optional[str], set_: list[str], runs: str,
                debug: bool, single_only: dict) -> None:
    """``nectar run`` of several documents: each in this process, the table at the end; exit 1 if any failed."""
    with _stoppable(debug):
        from . import corpus

        corpus.check_single_document_flags(**single_only)
        docs = corpus.plan(documents, preset, config, set_, runs)  # every document checked before the first runs
        from .prefect_api import prefect_api

        with prefect_api():
            from . import flows

            flows.CONSOLE_PROGRESS, flows.CONSOLE_NOTICE = _tqdm_progress, _notice
            rows = corpus.run_here(docs, lambda d: flows.nectar_pipeline(
                document=d.document, preset=preset, config_file=config, overrides=[*set_, *d.entry.overrides],
                run_dir=d.run_dir), _notice, lambda: shutdown.stopped_by()[0] is not None)
            corpus.publish(rows, corpus.corpus_name(documents))
        _report_corpus(rows, corpus.corpus_name(documents))


def _report_corpus(rows, name: str) -> None:
    from .corpus import table

    Console().print(table(rows, f"corpus {name}"))
    if any(r.state in ("failed", "crashed") for r in rows):
        _notice("fix the cause and run the same command again: finished documents are skipped, failed ones "
                "resume at their failed stage")
        raise typer.Exit(1)


def _checked_questions(path: str) -> str:
    """``--questions FILE``, checked before anything starts (one line naming the bad line), made absolute
    (a flow may run in another directory)."""
    from ..evaluation.questions import QuestionsFileError, read_questions

    path = os.path.abspath(path) if "://" not in path else path
    try:
        read_questions(path)
    except QuestionsFileError as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True, markup=False, highlight=False)
        raise typer.Exit(2)
    return path


class _Resume:
    """The command that resumes this one (the same arguments, naming the run directory once known)."""

    root: str | None = None

    def __call__(self) -> str:
        return resume_command(sys.argv[1:], self.root)


@contextmanager
def _stoppable(debug: bool) -> Iterator[_Resume]:
    """SIGINT / SIGTERM stop the command with one line naming the stage and the resume command
    (nectar/shutdown.py); every other failure is one line too (errors.py)."""
    resume = _Resume()
    try:
        with shutdown.handling_signals(forced_line=lambda stop, stage: interrupted_line(stop, resume())[0]), \
                reported(debug, _error_line, resume):
            check_environment_url()  # a server that is not there: one line in seconds, before anything loads
            yield resume
    except typer.Exit as done:
        if shutdown.stopped_by()[0] is not None:
            shutdown.exit_now(done.exit_code)  # the line is printed: stop the children and go
        raise


def _notice(message: str) -> None:
    console.print(message, markup=False, highlight=False, soft_wrap=True)


def _error_line(message: str) -> None:
    from rich.text import Text

    if not message.startswith("error: "):  # an interrupted run: not an error
        if console.is_terminal:
            console.print()  # below a progress bar the signal cut short
        console.print(Text(message, style="yellow"), highlight=False, soft_wrap=True)
        return
    console.print(Text("error: ", style="red") + Text(message[len("error: "):]), highlight=False, soft_wrap=True)


@app.command()
def sweep(
    document: str = typer.Argument("pydoc:naming"),
    grid: list[str] = typer.Option(["arch=mlp,quadrature", "regime=regression,mixed,distill"], "--grid",
                                   help="An axis: key=v1,v2 (arch, rho, lambda_kl, regime or any train.*/evaluate.* key)."),
    preset: str = typer.Option("cpu"),
    config: Optional[str] = typer.Option(None, "--config"),
    set_: list[str] = typer.Option([], "--set"),
    run_dir: Optional[str] = typer.Option(None, "--run-dir"),
    force: bool = typer.Option(False, "--force"),
    no_wait: bool = typer.Option(False, "--no-wait", help="Exit at once (code 3) if the run directory is busy."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and Prefect's own logs."),
) -> None:
    """Train and evaluate every combination of a grid on one document; print one comparison table."""
    _quiet_prefect(debug)
    with _stoppable(debug) as resume:
        from ..orchestration import plan_document, run_lock
        from ..schemas.presets import load_config
        from ..comparison.sweep import expand_variants, parse_grid

        cfg = load_config(preset, config, None, set_)
        expand_variants(cfg, parse_grid(grid))
        checked = plan_document(document, cfg, run_dir, force=force)  # the document and the run directory
        resume.root = checked.run.root
        from .prefect_api import prefect_api  # after _quiet_prefect: Prefect reads its settings on import

        with prefect_api(), run_lock(checked.run.root, wait=not no_wait, notify=_notice):
            from . import flows

            flows.CONSOLE_PROGRESS, flows.CONSOLE_NOTICE = _tqdm_progress, _notice
            result = flows.nectar_sweep(document=document, grid=list(grid), preset=preset, config_file=config,
                                        overrides=list(set_), run_dir=checked.run.root, force=force)
        typer.echo(result["table"])
        typer.echo(f"{result['run_dir']}/sweep/comparison.md")


@app.command()
def compare(
    run_dirs: List[str] = typer.Argument(..., help="A run directory whose data stages (chunk → targets) completed; "
                                          "several runs: their states composed, scored on the concatenated "
                                          "documents (docs/quality.md, \"Several documents at once\")."),
    rho: Optional[str] = typer.Option(None, "--rho", help="Further budgets, e.g. 0.02,0.05,0.10 (the run's ρ is "
                                                          "always compared)."),
    bytes_: Optional[str] = typer.Option(None, "--bytes", help="Budgets as fractions of the document KV's bytes "
                                          "at the model's KV dtype (float32 on the cpu preset, bfloat16 on GPU), "
                                          "e.g. 0.01,0.02,0.05: each system stores as many entries as its "
                                          "precision buys in those bytes."),
    systems: Optional[str] = typer.Option(
        None, "--systems", help="Comma-separated subset (default: every system but the opt-in matching@int8/int4: "
                                "none, full, regression, mixed, distill, cartridges, matching, truncate, evict, "
                                "attention_matching, recon_select, recon_fit, and each baseline @int8 and @int4); "
                                "kvpress presses by name: "
                                "kvpress:kvzip, kvpress:snapkv, …, kvpress:all, with :int8 / :int4 for quantized "
                                "keys and values (run in a venv of their own, built on first use); the run's state "
                                "as vLLM serves it: vllm:trained, vllm:attention_matching_kv@int4 (a vLLM server "
                                "each, `nectar llm setup` first; probe KL over vLLM's top-100 buckets, in a section "
                                "of its own). The run's own "
                                "states (run:first, run:refined) are always compared when it has them."),
    questions: Optional[str] = typer.Option(None, "--questions", help="JSONL of your own questions "
                                            "({\"question\": …, \"answer\": …} per line, answer optional): "
                                            "every system is scored on them as the split 'questions'."),
    out: Optional[str] = typer.Option(None, "--out", help="Write the comparison into this directory instead "
                                                          "of RUN_DIR/compare (several runs: instead of "
                                                          "RUN_A/compose/<documents>)."),
    positions: Optional[str] = typer.Option(None, "--positions", help="Several runs: the layouts the states are "
                                            "composed under, of concat, own, longest (default all three)."),
) -> None:
    """Every system at equal bytes on the run's held-out pairs: trains what is missing, writes
    RUN_DIR/compare/comparison.{parquet,md} and frontier.png (or into --out DIR). With several runs: their
    states composed against the full context of their documents concatenated (OUT/comparison.{parquet,md})."""
    if len(run_dirs) > 1:
        if questions:
            _error_line("error: --questions scores one run's states; give one run directory")
            raise typer.Exit(2)
        from .compose_cli import compare_runs

        return compare_runs(run_dirs, rho, bytes_, systems, out, positions)
    run_dir = run_dirs[0]
    _quiet_prefect()
    with _stoppable(False) as resume:
        resume.root = run_dir
        from ..comparison import CompareInputError, open_for_compare, parse_bytes, parse_rhos, validate

        names = [s.strip() for s in systems.split(",") if s.strip()] if systems else None
        questions = _checked_questions(questions) if questions else None
        try:  # fail fast, before Prefect starts or anything trains
            ctx = open_for_compare(run_dir)
            rhos = list(dict.fromkeys(parse_rhos(rho) + parse_bytes(bytes_, ctx.config.model.dtype)))
            validate(ctx, names, rhos)
        except CompareInputError as exc:
            console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
            raise typer.Exit(2)
        from . import flows
        from .prefect_api import prefect_api

        flows.CONSOLE_PROGRESS = _tqdm_progress
        try:
            with prefect_api():
                result = flows.nectar_compare(run_dir=run_dir, rhos=rhos or None, systems=names,
                                              questions=questions, out=out)
        except OrchestratorUnreachable:
            raise  # one line from _stoppable
        except Exception as exc:  # a train stage failed: its error.json is in its run dir; trained ones are cached
            if shutdown.stopped_by()[0] is not None:
                raise  # the run was asked to stop: _stoppable's line
            console.print(f"[red]error:[/red] {type(exc).__name__}: {exc}", soft_wrap=True)
            console.print("Fix the cause and run the same command again: trained systems are cached.")
            raise typer.Exit(1)
        typer.echo(result["table"])
        typer.echo(f"{result['out'].rstrip('/')}/comparison.md")


@app.command()
def status(run_dir: str = typer.Argument(..., help="A run directory, or a folder of runs (runs/<doc-id>).")) -> None:
    """Each stage of a run: done / cached / stale / failed / missing, with counts and the last error.

    ``stale``: completed, but an input or output changed since (every output byte is checked);
    the next `nectar run` redoes it."""
    from ..orchestration.executor import RunDir

    if RunDir(run_dir).exists("run.json"):
        _print_status(run_dir)
        return
    try:
        from .runs_status import print_runs_status
    except ImportError:
        console.print(f"[red]error:[/red] {run_dir} is not a run directory (no run.json)")
        raise typer.Exit(1)
    try:
        print_runs_status(run_dir)
    except FileNotFoundError as exc:  # a mistyped runs root: one line, not a traceback
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(1)


@app.command()
def ask(
    runs_and_question: List[str] = typer.Argument(..., metavar="RUN_DIR... QUESTION", help="Run directories with a "
                                                  "live state (several: their states composed), then "
                                                  "the question about the document(s)."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Default: the run's evaluate setting."),
    temperature: Optional[float] = typer.Option(None, help="0 for greedy; default: the run's evaluate setting."),
    seed: int = typer.Option(0),
    positions: str = typer.Option("concat", help="Several runs: where the documents sit (concat | own | longest)."),
    debug: bool = typer.Option(False, "--debug", help="Show the traceback of an error."),
) -> None:
    """Answer a question from the run's live state (the first state while self-study runs, the refined
    one once promoted), without the document in the context (streams); with several runs, from their
    states composed (docs/design.md §13)."""
    if len(runs_and_question) < 2:
        _error_line("error: give a run directory and a question: nectar ask RUN_DIR [RUN_DIR ...] \"QUESTION\"")
        raise typer.Exit(2)
    *run_dirs, question = runs_and_question
    if len(run_dirs) > 1:
        from .compose_cli import ask_runs

        return ask_runs(run_dirs, question, positions, max_new_tokens, temperature, seed, debug)
    run_dir = run_dirs[0]
    from ..serving.ask import ask as ask_module
    from .errors import reported

    with reported(debug, _error_line):
        ask_module(run_dir, question, stream=lambda text: (sys.stdout.write(text), sys.stdout.flush()),
                   max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    sys.stdout.write("\n")


@app.command("serve")
def serve_cmd(
    run_dirs: List[str] = typer.Argument(..., help="Run directories whose train stage completed, or directories "
                                         "of such runs; each run's module is served under its own model id."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0: every interface; needs "
                             "--api-key or --allow-unauthenticated)."),
    port: int = typer.Option(8000, help="TCP port (0: any free port; the URL is printed)."),
    api_key: Optional[List[str]] = typer.Option(None, help="A key clients must send as 'Authorization: Bearer "
                                                "<key>' (repeatable; also NECTAR_API_KEY, comma-separated)."),
    allow_unauthenticated: bool = typer.Option(False, help="Listen on a non-loopback address without a key."),
    max_batch: int = typer.Option(8, help="Requests decoded together in the running batch."),
    max_queue: int = typer.Option(64, help="Requests waiting for a batch row; beyond: 503 with Retry-After."),
    max_tokens: int = typer.Option(512, help="Largest max_tokens a request may ask for (400 beyond)."),
    max_prompt_tokens: int = typer.Option(4096, help="Largest conversation, in query tokens (400 beyond)."),
    max_body_bytes: int = typer.Option(1_000_000, help="Largest request body (413 beyond)."),
    max_stop: int = typer.Option(4, help="Stop strings per request (400 beyond)."),
    max_module_bytes: int = typer.Option(2_000_000_000, help="Modules kept in memory, in bytes (least recently "
                                         "used dropped beyond; reloaded when asked for again). Counts what a "
                                         "loaded module holds: a quantized module's codes and its float weights."),
    keep_dequantized: bool = typer.Option(True, "--keep-dequantized/--codes-only", help="A quantized module's "
                                          "float weights, dequantized once at load, kept beside its codes; "
                                          "--codes-only: the codes alone (several times fewer bytes per document, "
                                          "every decode step dequantizes them: slower, docs/deployment.md §13)."),
    batch_wait_ms: float = typer.Option(5.0, help="How long a new batch waits for more requests."),
    shutdown_timeout: float = typer.Option(120.0, help="On SIGTERM, wait this long for in-flight requests."),
    served_name: Optional[List[str]] = typer.Option(None, help="Model id clients send, one per run in order "
                                                    "(default <doc-id>/<run-id>; --engine vllm: one id for all)."),
    engine: str = typer.Option("torch", help="The serving engine, by name (nectar/serving/engines: ENGINES). "
                               "torch: this project's decode engine (every module type); vllm: vLLM's engine "
                               "with each document's state, β included, through NECTAR's attention backend plugin "
                               "(docs/deployment.md §14–15)."),
    dtype: str = typer.Option("bfloat16", help="--engine vllm: vLLM's dtype (float32 reproduces the torch "
                              "engine most closely)."),
    max_model_len: int = typer.Option(4096, help="--engine vllm: vLLM's window (m pseudo-tokens + query + answer)."),
    kv_cache_gib: int = typer.Option(2, help="--engine vllm: VLLM_CPU_KVCACHE_SPACE (GiB) on CPU."),
    enforce_eager: bool = typer.Option(False, help="--engine vllm: skip torch.compile (faster start, slower decode)."),
    state: Optional[str] = typer.Option(None, help="--engine vllm: which state: trained (default: the run's own "
                                        "state, β and all), or the β-free refit attention_matching_kv[@int4] for a "
                                        "vLLM without the NECTAR plugin."),
) -> None:
    """Serve runs' modules over one base model behind an OpenAI-compatible API (/v1/chat/completions,
    /v1/completions with --engine vllm, /v1/models, /metrics, /health)."""
    from ..serving.engines import ENGINES, EngineError, ServeOptions, unknown_engine

    chosen = ENGINES.get(engine)
    if chosen is None:
        console.print(f"[red]error:[/red] {unknown_engine(engine)}", soft_wrap=True)
        raise typer.Exit(2)
    opts = ServeOptions(host=host, port=port, api_key=tuple(api_key or ()),
                        allow_unauthenticated=allow_unauthenticated, max_batch=max_batch, max_queue=max_queue,
                        max_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens, max_body_bytes=max_body_bytes,
                        max_stop=max_stop, max_module_bytes=max_module_bytes, keep_dequantized=keep_dequantized,
                        batch_wait_ms=batch_wait_ms, shutdown_timeout=shutdown_timeout,
                        served_name=tuple(served_name or ()), dtype=dtype, max_model_len=max_model_len,
                        kv_cache_gib=kv_cache_gib, enforce_eager=enforce_eager, state=state)
    try:
        chosen.serve(list(run_dirs), opts, log=console.print)
    except EngineError as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(exc.exit_code)


def _print_status(run_dir: str) -> None:
    from ..orchestration import available_stages
    from ..orchestration.executor import RunDir, stage_status

    run = RunDir(run_dir)
    avail = set(available_stages())
    table = Table(title=f"run {run_dir}")
    for col in ("stage", "state", "counts", "seconds"):
        table.add_column(col)
    colors = {"done": "green", "cached": "cyan", "stale": "magenta", "failed": "red", "missing": "yellow"}
    for stage in STAGES:
        if stage not in avail:
            table.add_row(stage, "[dim]not available[/dim]", "", "")
            continue
        st = stage_status(run, stage)
        counts = ", ".join(f"{k}={v}" for k, v in list(st["counts"].items())[:8])
        if st["error"]:
            counts = st["error"].splitlines()[0][:160]
        elif st.get("stale"):
            counts = f"stale: {st['stale']}"[:200]
        table.add_row(stage, f"[{colors[st['state']]}]{st['state']}[/]", counts,
                      "" if st["duration_s"] is None else f"{st['duration_s']:.1f}")
    Console().print(table)
    _print_live(run)
    _print_comparison(run)


def _print_live(run) -> None:
    """The time to the first usable state and to the refined one, and which answers (issue 39)."""
    from ..orchestration.live import state_summary

    for line in state_summary(run):
        Console().print(line, soft_wrap=True, markup=False, highlight=False)


def _print_comparison(run) -> None:
    """One line pointing at the run's equal-bytes comparison (``nectar compare``), when there is one."""
    info = run.read_json("compare", "info.json")
    if info is None:
        return
    splits = ", ".join(f"{s} {n} pairs" for s, n in info.get("splits", {}).items())
    Console().print(f"comparison: {run.url('compare', 'comparison.md')} ({len(info.get('systems', []))} systems, "
                    f"ρ {', '.join(f'{r:g}' for r in info.get('rhos', []))}; {splits}; {info.get('created_at', '')})",
                    soft_wrap=True)


# ----- operations against a Prefect server: deploy / schedule / trigger / rerun / retry (deploy.py, operations.py) -----

_OVERRIDE = typer.Option(None, "--override", "-o", help="section.key=value (repeatable)")


def _fail(exc: Exception) -> NoReturn:
    typer.secho(f"error: {exc}", fg="red", err=True)
    raise typer.Exit(2)


def _print_registered(ids: dict[str, str]) -> None:
    for name, dep_id in ids.items():
        typer.echo(f"deployment {name}  ({dep_id})")


@app.command("deploy")
def deploy_cmd(
    pool: str = typer.Option(ops.DEFAULT_POOL, help="process work pool (created if missing)"),
    preset: str = typer.Option("cpu", help="default preset of the pipeline deployment"),
    config: str | None = typer.Option(None, "--config", help="default YAML config file"),
    override: list[str] | None = _OVERRIDE,
    working_dir: str | None = typer.Option(None, help="where flow runs execute; relative run dirs land here (default: cwd)"),
    gpus: int = typer.Option(1, min=1, help="GPU stages allowed to run at once"),
    llm_from_env: bool = typer.Option(False, help="point LLM roles at NECTAR_LLM_BASE_URL/NECTAR_JUDGE_BASE_URL"),
    cron: str | None = typer.Option(None, help="also schedule --document on this cron"),
    document: str | None = typer.Option(None, help="also deploy doc-<name> for this document URI "
                                                   "(local path or fsspec URL), on --cron if given"),
    run_dir: str | None = typer.Option(None, help="fixed run directory for the scheduled document"),
) -> None:
    """Register the pipeline and every stage as deployments (and optionally schedule a document)."""
    if cron and not document:
        _fail(ops.DeployError("--cron needs --document (the document to run on that schedule)"))
    overrides = [*(ops.llm_overrides_from_env(os.environ) if llm_from_env else []), *(override or [])]
    wd = working_dir or os.getcwd()
    try:
        _print_registered(ops.deploy(pool, preset, config, overrides, wd, gpus))
        if document:
            _print_registered(ops.schedule_document(document, cron, pool, preset, config, overrides,
                                                run_dir, wd))
    except Exception as exc:
        _fail(exc)


@app.command("schedule")
def schedule_cmd(
    document: str = typer.Argument(..., help="document URI (local path or fsspec URL)"),
    cron: str = typer.Option(..., help='cron expression, e.g. "0 2 * * *" (02:00 daily)'),
    timezone: str = typer.Option("UTC", help="time zone of the cron expression"),
    pool: str = typer.Option(ops.DEFAULT_POOL),
    preset: str = typer.Option("cpu"),
    config: str | None = typer.Option(None, "--config"),
    override: list[str] | None = _OVERRIDE,
    run_dir: str | None = typer.Option(None, help="fixed run directory (default: runs/<doc-id>/<run-id>)"),
    working_dir: str | None = typer.Option(None),
) -> None:
    """Schedule one document: a deployment ``doc-<name>`` with a cron and fixed parameters."""
    try:
        _print_registered(ops.schedule_document(document, cron, pool, preset, config, override, run_dir,
                                            working_dir or os.getcwd(), timezone))
    except Exception as exc:
        _fail(exc)


@app.command("trigger")
def trigger_cmd(
    documents: List[str] = typer.Argument(..., help="document URI (local path or fsspec URL); several, a glob, "
                                          "a directory or a manifest: a corpus (one flow run each)"),
    preset: str | None = typer.Option(None, help="default: the deployment's"),
    config: str | None = typer.Option(None, "--config"),
    override: list[str] | None = _OVERRIDE,
    run_dir: str | None = typer.Option(None, help="reuse a run directory (a retry skips its completed stages)"),
    from_stage: str | None = typer.Option(None, "--from", help="re-run this stage and everything after it"),
    only_stage: str | None = typer.Option(None, "--only", help="re-run only this stage"),
    force: bool = typer.Option(False, "--force", help="ignore the cache for every stage"),
    wait: bool = typer.Option(False, help="wait for the run to finish and print each stage's state"),
    timeout: float = typer.Option(3600.0, help="seconds to wait with --wait"),
    runs: str | None = typer.Option(None, "--runs", help="corpus: the run root every worker reaches "
                                    "(default: <the deployment's working dir>/runs)"),
    corpus_name: str | None = typer.Option(None, "--corpus", help="corpus: its name (tag corpus:<name>, "
                                           "artifact corpus-<name>)"),
    llm_url: str | None = typer.Option(None, "--llm-url", help="corpus: one OpenAI-compatible server for every "
                                       "document's LLM roles (synthesis, re-answer, judges)"),
    retries: int = typer.Option(1, min=0, help="corpus with --wait: retries of a failed or crashed run"),
) -> None:
    """Start a pipeline run for a document (or one per document of a corpus) through the Prefect server."""
    from .corpus import check_single_document_flags, corpus_name as default_name, is_corpus, trigger_command

    if is_corpus(documents) or runs or corpus_name or llm_url:
        try:
            check_single_document_flags(run_dir=run_dir, from_=from_stage, only=only_stage, force=force)
            rows = trigger_command(list(documents), preset, config, list(override or []), runs, corpus_name,
                                   llm_url, retries, wait, timeout, _notice)
        except Exception as exc:
            _fail(exc)
        return _report_corpus(rows, corpus_name or default_name(list(documents)))
    document = documents[0]
    try:
        _report(operations.trigger(document, preset, config, override, run_dir, from_stage, only_stage, force),
                wait, timeout)
    except Exception as exc:
        _fail(exc)


@app.command("rerun")
def rerun_cmd(
    run_dir: str = typer.Argument(..., help="an existing run directory (holds run.json)"),
    stage: str = typer.Argument(..., help=f"one of {', '.join(STAGES)}"),
    local: bool = typer.Option(False, help="run it in this process instead of on a worker"),
    wait: bool = typer.Option(False, help="wait for the run to finish"),
    timeout: float = typer.Option(3600.0),
) -> None:
    """Re-run ONE stage of an existing run on its existing inputs (its stage deployment, or --local)."""
    try:
        if local:
            from .flows import nectar_stage

            typer.echo(nectar_stage(run_dir=run_dir, stage=stage, force=True))
            return
        _report(operations.rerun_stage(run_dir, stage), wait, timeout)
    except Exception as exc:
        _fail(exc)


@app.command("retry")
def retry_cmd(
    flow_run: str = typer.Argument(..., help="flow run id, or the name of a failed run (latest is taken)"),
    wait: bool = typer.Option(False, help="wait for the run to finish"),
    timeout: float = typer.Option(3600.0),
) -> None:
    """Retry a failed pipeline run with the same parameters (completed stages are skipped)."""
    try:
        _report(operations.retry_flow_run(flow_run), wait, timeout)
    except Exception as exc:
        _fail(exc)


llm_app = typer.Typer(no_args_is_help=True, help="The vLLM server the pipeline uses (llm.backend: vllm).")
app.add_typer(llm_app, name="llm")


@llm_app.command("setup")
def llm_setup(
    preset: str = typer.Option("cpu", help="the preset whose server the warm-up starts (its synthesize.llm)"),
    config: Optional[str] = typer.Option(None, "--config", help="YAML file of overrides, as for `nectar run`."),
    warm: bool = typer.Option(True, help="Also warm vLLM's compile cache for the run's shapes (a compiled "
                                         "server only; skipped when an earlier setup warmed the same server)."),
    force_warm: bool = typer.Option(False, "--force-warm", help="Warm again even if the stamp says it was done."),
) -> None:
    """Build vLLM's own virtual environment (pinned; once; ~90-240 s and 3.4 GB on CPU), then warm its
    compile cache for the shapes a run uses, so the run's server start compiles nothing."""
    import time

    from ..llm import server_spec
    from ..vllm.venv import ensure_venv, venv_dir
    from ..vllm.warmup import warm_up, warmed
    from ..schemas.presets import load_config

    try:
        began = time.monotonic()
        typer.echo(f"vLLM ready: {ensure_venv()} (venv {venv_dir()}; {time.monotonic() - began:.0f} s)")
        if not warm:
            return
        cfg = load_config(preset, config_file=config)
        llm_cfg = cfg.synthesize.llm
        if llm_cfg.backend not in ("vllm", "auto") or llm_cfg.base_url:
            typer.echo(f"vllm warm-up: skipped (preset {preset} does not start a managed vLLM server)")
            return
        spec = server_spec(llm_cfg, cfg.model)
        if not spec.compile:
            typer.echo("vllm warm-up: skipped (the run's server is eager: nothing to compile)")
            return
        done = None if force_warm else warmed(spec)
        if done is not None:
            typer.echo(f"vllm warm-up: already done at {done['at']} ({done['total_s']:.0f} s); --force-warm redoes it")
            return
        warm_up(spec, venv_dir().parent / "logs" / "vllm-warm-up.log", concurrency=spec.max_num_seqs,
                echo=typer.echo)
    except Exception as exc:
        _fail(exc)


@llm_app.command("serve")
def llm_serve(
    model: Optional[str] = typer.Option(None, help="model directory or id (default: the preset's base model)"),
    preset: str = typer.Option("cpu", help="the preset whose synthesize.llm settings the server takes"),
    port: int = typer.Option(8000, help="port to listen on (0: a free one)"),
    host: str = typer.Option("127.0.0.1", help="address to bind (0.0.0.0 inside a container)"),
    log: str = typer.Option("vllm-serve.log", help="the server's log file"),
) -> None:
    """Start the pipeline's vLLM server standalone (for a Prefect worker or compose); print its URL.

    Point the pipeline at it with --set synthesize.llm.base_url=URL (and verify.answer_llm,
    verify.judge, evaluate.judge) and backend vllm. Ctrl-C stops it."""
    import dataclasses
    import time

    from ..llm import server_spec
    from ..vllm.server import VLLMServer
    from ..schemas.presets import load_config

    try:
        cfg = load_config(preset)
        llm_cfg = cfg.synthesize.llm.model_copy(update={"model": model, "port": port})
        spec = dataclasses.replace(server_spec(llm_cfg, cfg.model), host=host)
        with VLLMServer(spec, log) as server:
            typer.echo(f"vLLM {server.version} serving {spec.served_name} at {server.url} (log {log})", err=False)
            while server.running:
                time.sleep(1.0)
            raise RuntimeError(f"the vLLM server exited; see {log}")
    except KeyboardInterrupt:
        return
    except Exception as exc:
        _fail(exc)


def _report(flow_run, wait: bool, timeout: float) -> None:
    typer.echo(f"flow run {flow_run.name} ({flow_run.id}) scheduled")
    if not wait:
        return
    from .server_status import summary_lines

    done = operations.wait_for_run(flow_run.id, timeout)
    for line in summary_lines(done.id):
        typer.echo(f"  {line}")
    typer.echo(f"flow run {done.name}: {done.state.name}")
    if done.state.type.value != "COMPLETED":
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
