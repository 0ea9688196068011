"""Shared fixtures: one contract suite over every platform present.

``platform_name`` is parametrised over ``host`` (always) and ``cuda`` (marked
``gpu``: deselected by default, and skipped with the reason where CUDA is
unusable). ``platform`` is a fresh platform object, closed after the test.
"""
from __future__ import annotations

import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # for _spawn, also in spawned children

from _spawn import Spawner  # noqa: E402


@functools.lru_cache(maxsize=None)
def platform_reason(name: str) -> str | None:
    from gpuxfer.platforms import unavailable_reason
    return unavailable_reason(name)


PLATFORM_PARAMS = [
    pytest.param("host", id="host"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=PLATFORM_PARAMS)
def platform_name(request) -> str:
    why = platform_reason(request.param)
    if why is not None:
        pytest.skip(f"platform {request.param} unavailable: {why}")
    return request.param


@pytest.fixture
def platform(platform_name):
    from gpuxfer.platforms import get_platform
    p = get_platform(platform_name)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def host():
    from gpuxfer.platforms.host import HostPlatform
    p = HostPlatform()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def spawner():
    s = Spawner()
    try:
        yield s
    finally:
        s.cleanup()
