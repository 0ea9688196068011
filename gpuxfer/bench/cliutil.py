"""What the three benchmarks share on the command line: option checks, output places, atomic files.

One convention for ``gpuxfer bench kv|pp|kernels``:

* every option is checked in the parent, before any process starts; a bad value is
  :class:`~gpuxfer.errors.BadInput` naming the option, printed as one line
  (``gpuxfer bench NAME: error: ...``) with exit code 2, never a traceback;
* ``--out DIR``: where the run's files go. Left out, every run gets its own directory,
  ``gpuxfer-out/NAME/<UTC time>`` (``gpuxfer-out/NAME/latest`` points at the newest);
  given, DIR must not hold an earlier run's results (they are never overwritten). The
  place is checked (created, written to) before anything is measured;
* ``--json``: print the JSON document on stdout (the tables go to stderr); ``--json PATH``: write
  it to PATH instead, a new file in an existing directory (an existing PATH is refused up front, as
  ``--out`` refuses an earlier run, and never overwritten; the tables stay on stdout);
* ``--timeout SECONDS``: the limit on every single wait, default :data:`DEFAULT_TIMEOUT_S`;
* ``--iters`` / ``--trials`` >= 1 where given, ``--warmup`` >= 0;
* files are written atomically (a temporary file in the same directory, synced, then
  ``os.replace``, or linked into place where nothing may be overwritten) with mode 0644.
"""
from __future__ import annotations

import datetime as _dt
import os
import sys
import tempfile
from dataclasses import dataclass

from .. import config
from ..errors import BadInput

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_OUT_ROOT = "gpuxfer-out"
FILE_MODE = 0o644
PLATFORM_CHOICES = ("auto", "cuda", "rocm", "host")


# --------------------------------------------------------------------------- values


def int_option(text, option: str, *, minimum: int = 1) -> int:
    """An integer >= ``minimum`` (``BadInput`` naming ``option`` otherwise)."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise BadInput(f"{option}: {text!r} is not an integer") from None
    if value < minimum:
        raise BadInput(f"{option}: must be >= {minimum}, got {value}")
    return value


def seconds_option(text, option: str = "--timeout") -> float:
    """A positive, finite number of seconds."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise BadInput(f"{option}: {text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise BadInput(f"{option}: must be a positive number of seconds, got {text!r}")
    return value


def platform_option(text) -> str:
    """``--platform``: one of :data:`PLATFORM_CHOICES`, usable here unless ``auto``; the resolved name.

    Checks classes only (a driver query at most, no device context)."""
    from ..platforms import PLATFORMS, unavailable_reason
    name = str(text or config.get("GPUXFER_PLATFORM") or "auto").strip().lower()
    if name not in PLATFORM_CHOICES:
        raise BadInput(f"--platform: unknown platform {name!r}; known: {', '.join(PLATFORM_CHOICES)}")
    if name != "auto":
        why = unavailable_reason(name)
        if why is not None:
            raise BadInput(f"--platform: {name} cannot run here: {why}")
        return name
    for cand in PLATFORMS:
        if not _surely_missing(cand) and unavailable_reason(cand) is None:
            return cand
    raise BadInput("--platform: no platform can run here: " +
                   "; ".join(f"{n}: {unavailable_reason(n)}" for n in PLATFORMS))


#: a module each GPU platform cannot run without: where it is not installed, ``auto`` passes over the
#: platform without importing torch for its full check (a CPU machine's command line answers at once)
_REQUIRED_MODULE = {"cuda": "cupy", "rocm": "hip"}


def _surely_missing(name: str) -> bool:
    import importlib.util
    module = _REQUIRED_MODULE.get(name)
    try:
        return module is not None and importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return False


def device_count(platform: str) -> int:
    """How many devices ``platform`` (a usable name) shows this process (no device context is made)."""
    from ..platforms import get_platform
    plat = get_platform(platform)
    try:
        return plat.device_count()
    finally:
        plat.close()


def device_infos(platform: str, devices) -> list:
    """Each of ``devices``' :class:`~gpuxfer.platforms.values.DeviceInfo` on ``platform`` (a usable name), its
    free memory as it is now; the platform is closed after."""
    from ..platforms import get_platform
    plat = get_platform(platform)
    try:
        return [plat.device_info(d) for d in devices]
    finally:
        plat.close()


def check_room(option: str, value: int, wants) -> None:
    """``wants``: ``(bytes, DeviceInfo)`` pairs, what a run allocates on each device. More than a device's free
    memory is :class:`BadInput` naming ``option`` (whose value, ``value`` bytes, sets the need), raised before
    anything is allocated; a device whose free memory is unknown is not checked."""
    for need, info in wants:
        if info.free_bytes is not None and need > info.free_bytes:
            raise BadInput(f"{option} {value} B: the run needs {need} B on device {info.index} ({info.name}), "
                           f"which has {info.free_bytes} B free")


def add_common_arguments(group, *, name: str, timeout_help: str = "limit on every single wait (a device "
                         "burst, a CPU-group exchange); a hang becomes an error") -> None:
    """``--platform``, ``--timeout``, ``--out`` and ``--json`` as every benchmark spells them."""
    group.add_argument("--platform", default=None, metavar="NAME",
                       help=f"device platform: {', '.join(PLATFORM_CHOICES)} (host = the CPU emulation; default: "
                            "$GPUXFER_PLATFORM, else auto: the first usable of cuda, rocm, host)")
    group.add_argument("--timeout", default=str(int(DEFAULT_TIMEOUT_S)), metavar="SECONDS", help=timeout_help)
    group.add_argument("--out", default=None, metavar="DIR",
                       help=f"directory for the run's files; it must not hold an earlier run's (default: a new "
                            f"{DEFAULT_OUT_ROOT}/{name}/<UTC time>, {DEFAULT_OUT_ROOT}/{name}/latest the newest)")
    group.add_argument("--json", nargs="?", const=True, default=None, metavar="PATH",
                       help="print the JSON document on stdout (the tables go to stderr); --json PATH: write it "
                            "to PATH instead, a new file in an existing directory (the tables stay on stdout)")


# --------------------------------------------------------------------------- outputs


def _probe_dir(path: str, option: str) -> None:
    """Create ``path`` (and parents) and prove a file can be written in it."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".gpuxfer-probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise BadInput(f"{option}: cannot write in {path}: {exc.strerror or exc}") from None


@dataclass
class Outputs:
    """Where one run writes: its directory (None: nothing) and an extra JSON path (None: none)."""

    bench: str
    directory: str | None
    json_path: str | None = None
    json_stdout: bool = False
    _latest_root: str | None = None
    _created: bool = False          # the directory did not exist before this run

    def path(self, filename: str) -> str | None:
        return None if self.directory is None else os.path.join(self.directory, filename)

    def link_latest(self) -> None:
        """``<root>/latest`` -> this run's directory (default places only); never fails the run."""
        if self._latest_root is None or self.directory is None:
            return
        link = os.path.join(self._latest_root, "latest")
        tmp = f"{link}.{os.getpid()}.tmp"
        try:
            os.symlink(os.path.basename(self.directory), tmp)
            os.replace(tmp, link)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def publish(self, artifact: str, text: str, out) -> None:
        """Write the run's JSON ``text`` as ``artifact`` in its directory and at ``--json PATH`` (atomic,
        0644; PATH never overwritten), name each on ``out``, point ``latest`` here, and print it on stdout
        for a bare ``--json``."""
        for path, replace in ((self.path(artifact), True), (self.json_path, False)):
            if path:
                write_atomic(path, text + "\n", replace=replace)
                print(f"# json: {path}", file=out)
        self.link_latest()
        if self.json_stdout:
            print(text)

    def remove_if_empty(self) -> None:
        """A run that wrote nothing leaves no directory it made (a failed run is said on stderr)."""
        if self._created and self.directory is not None:
            try:
                os.rmdir(self.directory)
            except OSError:
                pass


def _new_run_dir(root: str) -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%SZ")
    for n in range(1000):
        path = os.path.join(root, stamp if n == 0 else f"{stamp}-{n}")
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue
    raise BadInput(f"--out: cannot find a new run directory under {root}")


def json_path_option(json_opt, *, create: bool = True, option: str = "--json") -> str | None:
    """``--json PATH``: the absolute path of a new file in an existing, writable directory (None for
    ``--json`` alone or none). An existing PATH is refused (its contents are kept, as ``--out`` keeps an
    earlier run's); a missing directory is refused, never created. ``create=False`` skips the write probe;
    ``option`` names the option in the errors (the scripts' ``--out FILE``)."""
    if json_opt in (None, True):
        return None
    path = str(json_opt)
    if not path.strip():
        raise BadInput(f"{option}: give a file name" + (", or no value to print the JSON on stdout"
                                                        if option == "--json" else ""))
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise BadInput(f"{option}: {path} is a directory")
    if os.path.lexists(path):
        raise BadInput(f"{option}: {path} exists; it is kept, not overwritten: choose another name or remove it")
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise BadInput(f"{option}: directory {directory} does not exist")
    if create:
        _probe_dir(directory, option)
    return path


def prepare_outputs(bench: str, out: str | None, json_opt, *, artifacts: tuple[str, ...], create: bool = True
                    ) -> Outputs:
    """Check (and with ``create``, make) where the run writes, before anything is measured.

    ``artifacts``: the file names a run leaves in its directory; an explicit ``--out``
    already holding one of them is refused (an earlier run's results are never
    overwritten). ``create=False`` checks the places without creating the run directory
    (a process that will not write)."""
    outputs = Outputs(bench, None, json_path_option(json_opt, create=create), json_stdout=json_opt is True)
    if out is not None:
        if not str(out).strip():
            raise BadInput("--out: give a directory")
        path = os.path.abspath(str(out))
        if os.path.exists(path) and not os.path.isdir(path):
            raise BadInput(f"--out: {path} exists and is not a directory")
        held = [a for a in artifacts if os.path.exists(os.path.join(path, a))]
        if held:
            raise BadInput(f"--out: {path} holds an earlier run's {held[0]}; its results are kept: choose "
                           "another directory, or leave --out out for a new one per run")
        if create:
            outputs._created = not os.path.exists(path)
            _probe_dir(path, "--out")
        outputs.directory = path
        return outputs
    root = os.path.abspath(os.path.join(DEFAULT_OUT_ROOT, bench))
    if create:
        _probe_dir(root, "--out")
        outputs.directory = _new_run_dir(root)
        outputs._latest_root, outputs._created = root, True
    return outputs


def write_atomic(path: str, data: str | bytes, *, mode: int = FILE_MODE, replace: bool = True) -> str:
    """Write ``data`` to ``path`` through a temporary file in the same directory, synced to disk before it
    takes the name: readers (and a crash) see the old file or the whole new one, never a part. With
    ``replace`` a file or symlink at ``path`` is replaced (not followed); without, an existing ``path`` is
    left as it is and :class:`BadInput` says so (the name is taken by a hard link, which never overwrites)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise BadInput(f"{path} exists; it is kept, not overwritten") from None
            os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _sync_dir(directory)
    return path


def _sync_dir(directory: str) -> None:
    """Make a new name in ``directory`` durable (best effort: some file systems refuse a directory fsync)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def error_line(command: str, exc: BaseException) -> int:
    """Print the one-line error of ``command`` on stderr; the exit code (2: bad input, 1: anything else)."""
    print(f"{command}: error: {exc}", file=sys.stderr)
    return 2 if isinstance(exc, BadInput) else 1
