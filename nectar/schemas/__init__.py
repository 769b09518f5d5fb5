"""Pydantic configs and artifacts: the contracts between stages."""
from .artifacts import *  # noqa: F401,F403
from .base import Artifact, FrozenConfig, stable_hash  # noqa: F401
from .config import *  # noqa: F401,F403
from .presets import PRESETS, REGIMES, ConfigError, load_config  # noqa: F401
