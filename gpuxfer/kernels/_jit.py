"""One kernel source, two ways to run it: compiled on a GPU, interpreted on the CPU.

``triton.jit`` decides at decoration time, from ``TRITON_INTERPRET``, whether a
kernel is compiled or interpreted, which ties a whole process to one mode and
to the order of imports. :class:`DualKernel` keeps the plain Python function and
picks per launch: CPU tensors (the host emulation) run in Triton's interpreter,
GPU tensors run compiled, and ``TRITON_INTERPRET=1`` forces the interpreter for
both.

Triton's own library functions (``tl.zeros``, ``tl.max``, ``tl.cdiv``...) and
any ``@triton.jit`` helper are compiled-mode ``JITFunction`` objects unless
``TRITON_INTERPRET=1`` was set before Triton was imported; while an interpreted
launch runs, calls to them are routed to Triton's ``InterpretedFunction`` of the
same source (exactly what ``TRITON_INTERPRET=1`` would have built at import).

Triton's interpreter patches ``triton.language`` while a kernel runs, so it is
not thread-safe; interpreted launches are serialised by a lock (the host
platform runs streams on worker threads).
"""
from __future__ import annotations

import contextlib
import threading

import triton
from triton import knobs
from triton.runtime.jit import JITFunction
from .. import config

#: ``0`` makes :meth:`DualKernel.launcher` launch through Triton every time (no direct launches)
ENV_DIRECT_LAUNCH = "GPUXFER_DIRECT_LAUNCH"
_INTERP_LOCK = threading.RLock()
_MISSING = object()
_INTERPRETED: dict = {}


def _interpreted_fn(fn):
    f = _INTERPRETED.get(fn)
    if f is None:
        from triton.runtime.interpreter import InterpretedFunction
        f = _INTERPRETED[fn] = InterpretedFunction(fn)
    return f


@contextlib.contextmanager
def _interpreter_fixes():
    """Patches that hold while one interpreted launch runs (the caller holds the lock).

    * ``JITFunction.__call__`` (a device-function call: ``tl.zeros``, ``tl.max``...)
      runs the interpreted version of the same source.
    * Triton 3.6's interpreter turns a scalar into an int with ``int(array)`` on a
      one-element 1-D array, which NumPy >= 2.4 refuses ("only 0-dimensional arrays
      can be converted"); ``range(tl.program_id(0), n, tl.num_programs(0))`` needs
      it. Its ``__index__`` is re-patched to take the single element.
    * The interpreter patches ``triton.language`` (and, through library functions,
      ``triton.language.core``) and does not undo all of it; everything it may touch
      is restored afterwards, so compiled launches in the same process still work.
    """
    from triton.runtime import interpreter as interp
    import triton.language as tl

    touched = (tl, tl.core, tl.math, tl.core.tensor, tl.core.dtype, tl.core.tensor_descriptor_base)
    snapshot = [(obj, dict(vars(obj))) for obj in touched]

    saved_call = JITFunction.__call__
    saved_patch = interp._patch_lang_tensor

    def _call(self, *args, **kwargs):
        return _interpreted_fn(self.fn)(*args, **kwargs)

    def _patch_lang_tensor(tensor, scope):
        saved_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    JITFunction.__call__ = _call
    interp._patch_lang_tensor = _patch_lang_tensor
    try:
        yield
    finally:
        JITFunction.__call__ = saved_call
        interp._patch_lang_tensor = saved_patch
        for obj, saved in snapshot:
            now = vars(obj)
            for name in [n for n in now if n not in saved]:
                try:
                    delattr(obj, name)
                except (AttributeError, TypeError):
                    pass
            for name, value in saved.items():
                if now.get(name, _MISSING) is not value:
                    try:
                        setattr(obj, name, value)
                    except (AttributeError, TypeError):
                        pass


def interpreting_forced() -> bool:
    """True when ``TRITON_INTERPRET=1`` asks for the interpreter everywhere."""
    return bool(knobs.runtime.interpret)


class DualKernel:
    """A Triton kernel source usable compiled (GPU tensors) or interpreted (CPU tensors)."""

    def __init__(self, fn, do_not_specialize=()):
        self.fn = fn
        self.do_not_specialize = tuple(do_not_specialize)
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._compiled = None
        self._interpreted = None
        self._fast: dict = {}           # launcher key -> the compiled kernel's (run, function, metadata)
        names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        self._plain = frozenset(i for i, n in enumerate(names) if n in self.do_not_specialize or i in
                                self.do_not_specialize)     # the integers Triton keys by their type alone

    def compiled(self):
        if self._compiled is None:
            self._compiled = JITFunction(self.fn, do_not_specialize=self.do_not_specialize)
        return self._compiled

    def interpreted(self):
        if self._interpreted is None:
            self._interpreted = _interpreted_fn(self.fn)
        return self._interpreted

    def launch(self, device, grid, *args, **kwargs):
        """Launch on ``device`` (a torch.device) with ``grid``; returns what Triton returns."""
        if device.type == "cpu" or interpreting_forced():
            # num_warps & co. mean nothing to the interpreter (and it rejects unknown names)
            for k in ("num_warps", "num_stages", "num_ctas", "maxnreg"):
                kwargs.pop(k, None)
            with _INTERP_LOCK, _interpreter_fixes():
                return self.interpreted()[grid](*args, **kwargs)
        import torch
        with torch.cuda.device(device):
            return self.compiled()[grid](*args, **kwargs)


    def launcher(self, device, grid, *args, **kwargs):
        """A function launching the kernel like :meth:`launch` (on torch's current stream of ``device``, or on
        the driver stream handle passed as ``stream``), for a launch made with fixed arguments.

        Compiled, it goes straight to the compiled kernel's launcher with the arguments bound once
        (tensors as their addresses), skipping Triton's per-call argument binding, specialisation and
        cache lookup. The compiled kernel is the one Triton chose for arguments of the same kind
        (:func:`_spec_key`: dtypes, 16-byte alignment, the integers' ranges, ``== 1`` and ``% 16`` but for
        ``do_not_specialize``'s; the constexprs and options): the first launch of a kind goes through Triton
        and remembers it. The arguments' tensors must stay alive (and in place) while the launcher is used.
        """
        if device.type == "cpu" or interpreting_forced():
            def interpreted(stream=None) -> None:
                self.launch(device, grid, *args, **kwargs)
            return interpreted
        names = self.fn.__code__.co_varnames[:self.fn.__code__.co_argcount]
        if (len(args) > len(names) or any(n not in kwargs for n in names[len(args):])
                or not config.get(ENV_DIRECT_LAUNCH)):
            return lambda stream=None: self._launch_on(device, stream, grid, args, kwargs)
        values = list(args) + [kwargs[n] for n in names[len(args):]]
        bound = tuple(v.data_ptr() if hasattr(v, "data_ptr") else v for v in values)
        key = (device.index or 0, _spec_key(values, self._plain), tuple(kwargs.items()))
        g = tuple(grid) + (1,) * (3 - len(grid))
        index = device.index if device.index is not None else 0
        fast = self._fast

        found: list = []                # the compiled kernel's entry, once known

        def launch(stream=None) -> None:
            import torch
            if not found and key in fast:
                found.append(fast[key])
            if not found or _hooks_active() or torch.cuda.current_device() != index:
                kernel = self._launch_on(device, stream, grid, args, kwargs)
                if not found and kernel is not None and hasattr(kernel, "packed_metadata"):
                    fast[key] = (kernel.run, kernel.function, kernel.packed_metadata)
                return
            run, function, meta = found[0]
            run(g[0], g[1], g[2], _current_stream(index) if stream is None else stream, function, meta, None, None,
                None, *bound)
        return launch

    def _launch_on(self, device, stream, grid, args, kwargs):
        """:meth:`launch`, on the driver stream handle ``stream`` when given."""
        if stream is None:
            return self.launch(device, grid, *args, **kwargs)
        import torch
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
            return self.launch(device, grid, *args, **kwargs)


def _hooks_active() -> bool:
    """Whether a launch hook (a profiler's) is installed: launches then go through Triton, which calls it."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _current_stream(index: int):
    return triton.runtime.driver.active.get_current_stream(index)


def _spec_key(values, plain=frozenset()) -> tuple:
    """What Triton specialises a compiled kernel on, per argument, or finer: tensors by dtype and 16-byte
    alignment; integers by range (i32 / i64 / u64), and ``== 1`` and ``% 16 == 0`` unless their position is in
    ``plain`` (the kernel's ``do_not_specialize``: Triton keys those by their type alone); anything else by type
    and value. Two argument lists with equal keys run the same compiled kernel."""
    key = []
    for i, v in enumerate(values):
        if hasattr(v, "data_ptr"):
            key.append(("t", str(getattr(v, "dtype", "")), v.data_ptr() % 16 == 0))
        elif isinstance(v, bool) or not isinstance(v, int):
            key.append((type(v).__name__, repr(v)))
        elif i in plain:
            key.append(("i", -(1 << 31) <= v < 1 << 31, v < 1 << 63))
        else:
            key.append(("i", -(1 << 31) <= v < 1 << 31, v < 1 << 63, v == 1, v % 16 == 0))
    return tuple(key)


def dual_kernel(fn=None, *, do_not_specialize=()):
    """Decorator: ``@dual_kernel`` (or ``@dual_kernel(do_not_specialize=[...])``) instead of ``@triton.jit``.

    ``do_not_specialize`` names integer arguments Triton should not recompile for
    (by default it specialises on ``== 1`` and ``% 16 == 0``).
    """
    if fn is None:
        return lambda f: DualKernel(f, do_not_specialize)
    return DualKernel(fn, do_not_specialize)
