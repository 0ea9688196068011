"""A stand-in for sgl_kernel on SGLang's import chain on a GPU machine without SGLang's compiled kernels (see
../README.md): SGLang's model and quantization modules import kernels by name at module level when CUDA is
present, and the disaggregation classes the tests drive call none of them. Every name and every
``sgl_kernel.*`` submodule imports; calling anything raises."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+gpuxfer.stub"


class _Unusable:
    """Any name of sgl_kernel: its attributes are stand-ins too (``scalar_types.uint4b8``); calling one raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unusable(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{self._name} is gpuxfer's test stand-in (tests/integrations/sglang_stubs): "
                           "install SGLang's sgl-kernel to run its kernels")

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._name}>"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unusable(name)


class _Stub(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unusable(f"{self.__name__[len('sgl_kernel.'):]}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``sgl_kernel.<anything>`` as a stand-in module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
