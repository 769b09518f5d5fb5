"""The attention-state core (docs/design.md §2): capture, blend and the exact oracle share one identity."""
from .state import AttnState, attention_state, merge_states  # noqa: F401
