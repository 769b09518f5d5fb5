"""Verification answer time per instruction, with vs without prefix-KV reuse, vs document length.

Verification re-answers every instruction with the WHOLE document in the prompt (paper App. H
answer prompt, document first). Without reuse every request prefills the document; with reuse
the local backend prefills it once, then each batch of questions runs on top of that cache.

For each document it reports, on the embedded SmolLM2-135M (greedy, fixed max_new_tokens):
  no-reuse   : seconds per instruction, every request prefilling its own document (same batch
               size; fewer instructions by default, it is slow)
  reuse cold : seconds per instruction including the one-time document prefill
  reuse warm : seconds per instruction with the document cache already built (the marginal cost
               of one more instruction — what matters for hundreds of instructions)
and the ratios no-reuse / reuse. The claim to check: reuse-warm time per instruction stays
roughly flat as the document grows while no-reuse grows with it.

    .venv/bin/python benchmarks/bench_verify_prefix.py [--threads 2] [--instructions 8] [--new-tokens 32]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared cores: don't spin-wait (set before torch loads)

import torch  # noqa: E402

from nectar.documents import load_document  # noqa: E402
from nectar.llm import ChatRequest  # noqa: E402
from nectar.llm.local import LocalBackend  # noqa: E402
from nectar.base_model import load_base_model  # noqa: E402
from nectar.prompts import answer_prompt  # noqa: E402
from nectar.schemas.config import ModelConfig  # noqa: E402

QUESTIONS = [
    "What is a code block in Python?", "When is a name considered local to a block?",
    "What exception is raised when a name is not found?", "What does the global statement do?",
    "How does the nonlocal statement differ from global?", "What is the scope of a name defined in a class block?",
    "What is the execution frame of a code block?", "How are builtins looked up?",
    "What is a namespace?", "When are names bound?", "What does del do to a name?", "What is a closure?",
]
DOCUMENTS = {
    "naming": ["pydoc:naming"],
    "customization": ["pydoc:customization"],
    "naming+customization+execmodel": ["pydoc:naming", "pydoc:customization", "pydoc:execmodel"],
}


def document(parts: list[str]) -> str:
    return "\n\n".join(load_document(p)[0] for p in parts)


def requests(doc: str, n: int, new_tokens: int) -> list[ChatRequest]:
    return [ChatRequest(messages=({"role": "user", "content": answer_prompt(doc, q)},), max_new_tokens=new_tokens)
            for q in QUESTIONS[:n]]


def timed(backend: LocalBackend, reqs: list[ChatRequest]) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = backend.chat_many(reqs)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--instructions", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--baseline-instructions", type=int, default=4,
                    help="instructions for the slow no-reuse baseline (reported per instruction)")
    ap.add_argument("--docs", nargs="*", default=list(DOCUMENTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = load_base_model(ModelConfig())
    n = args.instructions
    print(f"model {base.name} · threads {args.threads} · {n} instructions ({args.baseline_instructions} for the "
          f"no-reuse baseline) · batch {args.batch_size} · {args.new_tokens} new tokens greedy · "
          f"load avg {os.getloadavg()[0]:.1f}")
    header = (f"{'document':32s} {'doc tok':>7s} {'no-reuse s/instr':>16s} {'reuse cold':>10s} "
              f"{'reuse warm':>10s} {'cold ratio':>10s} {'warm ratio':>10s} {'same text':>9s}")
    print(header)
    print("-" * len(header))
    for name in args.docs:
        doc = document(DOCUMENTS[name])
        reqs = requests(doc, n, args.new_tokens)
        reuse = LocalBackend(base, batch_size=args.batch_size, reuse_prefix=True)
        doc_tokens = reuse.prompt_tokens(requests(doc, 1, 1)[0])
        t_cold, out_cold = timed(reuse, reqs)
        t_warm, _ = timed(reuse, reqs)  # the document cache is in the LRU now
        plain = LocalBackend(base, batch_size=args.batch_size, reuse_prefix=False)
        nb = min(n, args.baseline_instructions)
        t_plain, out_plain = timed(plain, reqs[:nb])
        same = all(a.text == b.text for a, b in zip(out_cold, out_plain))
        per_plain, per_cold, per_warm = t_plain / nb, t_cold / n, t_warm / n
        print(f"{name:32s} {doc_tokens:7d} {per_plain:16.2f} {per_cold:10.2f} {per_warm:10.2f} "
              f"{per_plain / per_cold:9.1f}x {per_plain / per_warm:9.1f}x {str(same):>9s}", flush=True)


if __name__ == "__main__":
    main()
