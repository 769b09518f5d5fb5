"""NECTAR modules (docs/design.md §6): per (layer, KV head) score a(q) and target A(q) networks.

MLP and Quadrature families, budgets from ρ, the provider that plugs a module into the attention
core, and safetensors + JSON spec storage.
"""
from .budget import BudgetError  # noqa: F401
from .builder import ModulePlan, NectarModule, build_module, plan_from_config, plan_module  # noqa: F401
from .io import ModuleMismatch, load_module, make_spec, save_module  # noqa: F401
