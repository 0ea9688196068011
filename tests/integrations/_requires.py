"""The gate at the top of the test modules that drive vLLM or SGLang themselves."""
from __future__ import annotations

import importlib.util

import pytest

from gpuxfer import config


def require(module: str, env: str, pin: str) -> None:
    """Skip the calling test module where ``module`` is not importable, unless ``env`` (CI's step for that
    framework) asks for it: then a missing ``module`` is an ImportError, a failure. ``pin``: what to install."""
    if importlib.util.find_spec(module) is not None:
        return
    needs = f"tests/integrations/requirements-{module}.txt"
    if config.get(env):
        raise ImportError(f"{env}=1 but {module} is not installed ({needs})")
    pytest.skip(f"{module} is not installed (pip install --no-deps {pin} and {needs})", allow_module_level=True)
