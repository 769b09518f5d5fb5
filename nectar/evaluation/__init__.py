"""Evaluation (docs/design.md §5, paper §4.2–4.3, App. C, F, G): teacher-forced metrics, generations,
the LLM judge, the generation benchmark and the run report. No Prefect import here."""
