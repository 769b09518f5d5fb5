"""Prompt templates from the paper, verbatim (App. H: data generation and verification; App. G:
generation-quality judging), plus the JSON schemas we ask for as structured output.

Templates are the .txt files beside this module. They contain literal JSON braces, so
placeholders are filled by name (``{chunk}``), never with ``str.format``.
"""
from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any

from ..schemas.config import TaskType

INSUFFICIENT = "INSUFFICIENT_CONTEXT"

# Per-task consistency criteria for the verification judge (App. H, "Task-specific consistency criteria").
TASK_GUIDANCE: dict[str, str] = {
    "qa": "Responses must contain the same core factual information; different phrasing or level of detail "
          "is acceptable.",
    "summarization": "Both summaries should cover the same key points; different organizational choices are "
                     "acceptable.",
    "quoting": "Quoted text must be identical or near-identical; minor differences in quote boundaries are "
               "acceptable.",
    "paraphrasing": "Both paraphrases must preserve the same meaning; different stylistic choices are acceptable "
                    "as long as factual content matches.",
}

# Per-task rubrics of the ground-truth evaluation prompt (App. G, "Task-specific rubrics").
EVAL_RUBRICS: dict[str, str] = {
    "qa": "Does the response convey the same information as the ground truth? Score based on semantic match, "
          "not wording. Additional elaboration should not reduce the score.",
    "summarization": "Does the response convey the same overall meaning? Different organization, wording, or "
                     "level of detail is fine. Score based on whether a reader would come away with the same "
                     "understanding.",
    "quoting": "Does the response identify and convey the same passage? Score based on whether the same content "
               "is captured, not exact wording. Minor word variations or boundary differences are acceptable.",
    "paraphrasing": "Does the response convey the same meaning? Different wording is expected and should not "
                    "reduce the score. Score based on whether a reader would understand the same thing from both.",
}

# Appended to the generation prompts when the reply is schema-constrained: the paper's plain form
# "<scratchpad>…</scratchpad> [ … ]" becomes one JSON object whose scratchpad still comes first.
# (Described in words, without placeholder values: a small model copies "..." literally.)
STRUCTURED_NOTE = (
    '\n\nOutput format: a single JSON object with two keys: "scratchpad", a string with your bullet '
    'points, then "pairs", a list of exactly {count} objects, each with an "instruction" string and a '
    '"response" string.'
)

# Length caps keep a small model inside its token budget (a truncated reply doesn't parse). Few
# distinct values on purpose: xgrammar compiles each new string-length bound in ~1-5 s.
INSTRUCTION_MIN_CHARS = 12  # rules out "...", "template" and other copied placeholders
INSTRUCTION_MAX_CHARS = 600
REASONING_MAX_CHARS = 240

CONSISTENCY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "is_consistent": {"type": "boolean"},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "reasoning": {"type": "string", "maxLength": REASONING_MAX_CHARS},
    },
    "required": ["is_consistent", "confidence", "reasoning"],
    "additionalProperties": False,
}

EVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
        "reasoning": {"type": "string", "maxLength": REASONING_MAX_CHARS},
    },
    "required": ["score", "reasoning"],
    "additionalProperties": False,
}


def synthesis_schema(count: int, max_chars: int = INSTRUCTION_MAX_CHARS) -> dict[str, Any]:
    """The structured output of a synthesis request; ``max_chars`` bounds every string field so a
    small model can't run past its token budget inside one string."""
    pair = {
        "type": "object",
        "properties": {
            "instruction": {"type": "string", "minLength": min(INSTRUCTION_MIN_CHARS, max_chars),
                            "maxLength": max_chars},
            "response": {"type": "string", "minLength": 1, "maxLength": max_chars},
        },
        "required": ["instruction", "response"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "scratchpad": {"type": "string", "maxLength": max_chars},
            "pairs": {"type": "array", "items": pair, "minItems": count, "maxItems": count},
        },
        "required": ["scratchpad", "pairs"],
        "additionalProperties": False,
    }


_PLACEHOLDER = re.compile(r"\{([A-Za-z_]+)\}")


@functools.cache
def template(name: str) -> str:
    return resources.files(__package__).joinpath(f"{name}.txt").read_text(encoding="utf-8").rstrip("\n")


def render(text: str, **values: Any) -> str:
    """Fill ``{name}`` placeholders in one pass (text inserted for one placeholder is never
    scanned again, so a document containing "{instruction}" stays intact)."""
    missing = [k for k in values if "{" + k + "}" not in text]
    if missing:
        raise KeyError(f"template has no placeholder(s) {missing}")
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), text)


def synthesis_prompt(task: TaskType, chunk: str, count: int, structured: bool) -> str:
    prompt = render(template(f"synth_{task}"), count=count, chunk=chunk)
    if structured:
        prompt += STRUCTURED_NOTE.replace("{count}", str(count))
    return prompt


def answer_prompt(context: str, instruction: str, context_type: str = "document") -> str:
    """The paper's answer prompt; the context comes before the instruction, so every question about
    one document shares the same token prefix (one prefix KV cache in the local backend)."""
    return render(template("answer"), context_type=context_type, Context_Label=context_type.capitalize(),
                  context=context, instruction=instruction)


def consistency_prompt(task: TaskType, instruction: str, response_chunk: str, response_full: str) -> str:
    return render(template("consistency"), task_guidance=TASK_GUIDANCE[task], instruction=instruction,
                  response_chunk=response_chunk, response_full=response_full)


def eval_ground_truth_prompt(task: TaskType, context_chunk: str, instruction: str, ground_truth: str,
                             generated: str) -> str:
    return render(template("eval_ground_truth"), context_chunk=context_chunk, instruction=instruction,
                  ground_truth=ground_truth, generated=generated, rubric=EVAL_RUBRICS[task])


def eval_compare_prompt(instruction: str, base_generated: str, generated: str) -> str:
    return render(template("eval_compare"), instruction=instruction, base_generated=base_generated,
                  generated=generated)


def placeholders(name: str) -> set[str]:
    """Placeholder names in a template (``{word}`` with no quotes or spaces inside)."""
    return set(_PLACEHOLDER.findall(template(name)))
