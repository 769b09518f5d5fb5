"""The comparison markdown: reference rows first, then by budget and KL recovered, with intervals."""
from nectar.comparison.table import comparison_markdown


def _row(system, kind, rho, nbytes, rec, lo=None, hi=None, split="test"):
    return {"system": system, "kind": kind, "rho": rho, "state_bytes": nbytes, "split": split, "n_pairs": 5,
            "n_tokens": 177, "n_agreement": 5, "kl_to_full": 1 - rec, "kl_ci_low": None, "kl_ci_high": None,
            "recovered_kl": rec, "recovered_kl_ci_low": lo, "recovered_kl_ci_high": hi, "token_acc": 0.7,
            "token_acc_ci_low": 0.65, "token_acc_ci_high": 0.75, "agreement_exact": 0.2, "train_seconds": None}


def test_rows_are_ordered_and_formatted():
    rows = [_row("evict", "method", 0.05, 3_500_000, 0.85, 0.79, 0.93),
            _row("regression", "trained", 0.05, 3_410_000, 0.63, 0.57, 0.71),
            _row("full", "reference", None, 70_400_000, 1.0, 1.0, 1.0),
            _row("mixed", "trained", 0.02, 1_400_000, 0.5, 0.4, 0.6),
            _row("none", "reference", None, 0, 0.0, 0.0, 0.0)]
    md = comparison_markdown(rows, {"run": "runs/x", "kv_bytes": 70_400_000}, "frontier.png")
    table = [line for line in md.splitlines() if line.startswith("| ") and "system" not in line]
    assert [line.split(" | ")[0][2:] for line in table] == ["none", "full", "mixed", "evict", "regression"]
    assert "| evict | method | 0.05 | 3.500 MB (20.1×, 4.97 %) | 0.150 | 85.0 [79.0, 93.0] | 70.0 [65.0, 75.0] |" in md
    assert "| none | reference | – | 0 |" in md and "## test: 5 pairs, 177 response tokens; agreement on 5" in md
    assert "**document KV cache** 70.40 MB" in md and md.rstrip().endswith("![KL recovered vs bytes](frontier.png)")
