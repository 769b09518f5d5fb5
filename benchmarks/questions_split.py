"""The default state of finished runs on a questions file: teacher-forced module / full / none on the
``questions`` split only (no greedy agreement, no judge: seconds, not the evaluate stage's minutes).

    python benchmarks/questions_split.py RUN_DIR [RUN_DIR …] --questions docs/examples/naming-questions.jsonl

Prints, per run, token accuracy and KL recovered with 95 % paired bootstrap intervals over the
questions; reference answers are cached in RUN_DIR/questions/ as in ``nectar run --questions``."""
from __future__ import annotations

import argparse
import time

from nectar.attention.exact import ExactDocState
from nectar.evaluation.quality import split_quality
from nectar.evaluation.questions import load_questions
from nectar.evaluation.teacher import teacher_forced_pair_sums
from nectar.layout import build_layout
from nectar.modules.io import load_module
from nectar.modules.provider import ModuleDocState
from nectar.orchestration.context import load_base, load_run_doc_kv, open_run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--questions", required=True)
    args = ap.parse_args()
    for run_dir in args.runs:
        t0 = time.perf_counter()
        ctx = open_run(run_dir)
        base = load_base(ctx.config)
        layout = build_layout(base.tokenizer, ctx.text)
        doc_kv = load_run_doc_kv(ctx)
        full = ExactDocState(doc_kv)
        q = load_questions(args.questions, base, layout, full, ctx.run.url("questions"), ctx.config.evaluate)
        module, _ = load_module(ctx.run.url("train"), base, ctx.info.sha256, device=base.device)
        sums = teacher_forced_pair_sums(base, {"full": full, "none": None, "module": ModuleDocState(module)},
                                        q.pairs, layout.n, batch_size=6)
        quality = split_quality(sums, None, "questions", ctx.config.evaluate.bootstrap_resamples,
                                ctx.config.evaluate.seed)
        print(f"== {run_dir}: {len(q.pairs)} questions ({q.counts()['questions_answers_given']} answers given, "
              f"{q.generated} generated now), {time.perf_counter() - t0:.0f} s")
        for name in ("module", "full", "none"):
            s = quality[name]
            print(f"  {name:6s} tokens {s.n_tokens}  token acc {s.token_acc.fmt(1, 100)}  KL {s.kl_to_full.fmt(3)}"
                  f"  recovered {s.recovered_kl.fmt(1, 100)}")


if __name__ == "__main__":
    main()
