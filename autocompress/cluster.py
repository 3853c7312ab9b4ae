"""Joining Ray (local, or a cluster by address, token authentication included) and copying run folders to shared storage."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from autocompress.errors import ConfigError

GIB = 1024**3

AUTH_HINT = (
    "the cluster uses token authentication and this process has no valid token for it: set RAY_AUTH_MODE=token and "
    "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token (`ray get-auth-token` on the head node)"
)


def check_ray_address(address: str) -> None:
    """Fail fast with a clear message when a host:port address does not answer."""
    if address == "auto":
        return
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray.address={address!r} is not host:port, ray://host:port or auto")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise ConfigError(
            f"ray.address={address!r} is unreachable ({exc}); start the cluster (ray start --head) or drop ray.address to run on local Ray"
        ) from exc


def _auth_failure(exc: BaseException) -> bool:
    from ray.exceptions import AuthenticationError

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, AuthenticationError) or "InvalidAuthToken" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def init_ray(address: str | None) -> None:
    """Start local Ray (address None) or join the cluster at `address`; no-op if Ray is already up.

    Under `ray job submit`, RAY_ADDRESS is set and address None joins that cluster. Ray 2.59+ turns
    token authentication on for a local cluster it starts; joining a cluster by an explicit address
    never does, so the token must come with the environment (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN).
    """
    import ray

    if ray.is_initialized():
        return
    if address:
        check_ray_address(address)
    try:
        if address:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        else:
            ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        where = f"ray.address={address!r}" if address else f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS', '')!r}"
        if _auth_failure(exc):
            raise ConfigError(f"could not join the Ray cluster at {where}: {AUTH_HINT}") from exc
        if not address and not os.environ.get("RAY_ADDRESS"):
            raise
        raise ConfigError(f"could not join the Ray cluster at {where}: {exc}") from exc
    python_sigterm()


def check_trial_fits(cpus: float, gpus: float, memory_gib: float | None = None) -> None:
    """Refuse, before any trial, resources per trial that no live node of the Ray cluster has (Tune would wait forever).

    memory_gib: Ray's `memory` resource a trial reserves (None = none reserved).
    """
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    need = float(memory_gib or 0) * GIB
    if any(r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus and r.get("memory", 0) >= need for r in nodes):
        return
    top_cpu = max((r.get("CPU", 0) for r in nodes), default=0)
    top_gpu = max((r.get("GPU", 0) for r in nodes), default=0)
    top_mem = max((r.get("memory", 0) for r in nodes), default=0) / GIB
    asked = f"sweep.cpus_per_trial={cpus:g} and sweep.gpus_per_trial={gpus:g}"
    has = f"a node has at most {top_cpu:g} CPUs, at most {top_gpu:g} GPUs"
    if memory_gib:
        asked = f"sweep.cpus_per_trial={cpus:g}, sweep.gpus_per_trial={gpus:g} and sweep.memory_per_trial_gib={memory_gib:g}"
        has += f", at most {top_mem:.1f} GiB of Ray memory"
    raise ConfigError(
        f"a trial asks for {asked}, but no node of the Ray cluster has {'all of it' if memory_gib else 'both'} ({has}); "
        "lower them, or add a node that size (an autoscaling cluster: start one first)"
    )


class PendingWatch:
    """Notices a sweep whose trials stay pending with none running (a cluster that cannot place them).

    `step(trials)` is fed Tune's trial list at every controller step: after `warn_s` of pending trials
    and nothing running it logs one warning naming the resources; after `timeout_s` (None = never) it
    sets `timed_out`, which a Tune stopper (`stop_all`) turns into the end of the experiment. Any
    running trial, or none pending, resets the clock.
    """

    def __init__(self, warn_s: float, timeout_s: float | None, resources: str, clock: Callable[[], float] = time.monotonic):
        self.warn_s, self.timeout_s, self.resources, self.clock = warn_s, timeout_s, resources, clock
        self.since: float | None = None
        self.warned = self.timed_out = False

    def step(self, statuses: list[str]) -> None:
        if "RUNNING" in statuses or "PENDING" not in statuses:
            self.since, self.warned = None, False
            return
        now = self.clock()
        self.since = now if self.since is None else self.since
        waited = now - self.since
        if waited >= self.warn_s and not self.warned:
            self.warned = True
            limit = f"; giving up after {self.timeout_s:g} s (sweep.pending_timeout_s)" if self.timeout_s is not None else ""
            print(
                f"warning: no trial has started for {waited:.0f} s: the Ray cluster has no free node with {self.resources} "
                f"(an autoscaling cluster may still be adding one){limit}",
                file=sys.stderr,
                flush=True,
            )
        if self.timeout_s is not None and waited >= self.timeout_s:
            self.timed_out = True

    def error(self, resume: str) -> ConfigError:
        return ConfigError(
            f"no trial could start for {self.timeout_s:g} s (sweep.pending_timeout_s): the Ray cluster has no free node with "
            f"{self.resources}; add a node that size or lower the per-trial resources, then finish the run with {resume} "
            "(finished trials are kept)"
        )


def python_sigterm() -> None:
    """Give SIGTERM back to its Python handler (on the main thread; elsewhere it cannot be set).

    Ray's core worker puts its C++ crash reporter on SIGTERM, which runs the Python handler and
    then aborts the process (exit 134, a stack dump): a `ray job stop` or a pod eviction would look
    like a crash and skip the CLI's own clean-up.
    """
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGTERM)
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def start_ray(address: str | None) -> Callable[[], None]:
    """Start `init_ray(address)` on a thread and return a function that waits for it (raising what it raised).

    Starting local Ray takes seconds of process start-up; the sweep overlaps it with computing the
    teacher's outputs. The thread then stays parked until the process exits: Ray's processes die
    with the thread that started them (PR_SET_PDEATHSIG). Off the main thread, ray.init leaves the
    process's SIGTERM handler alone, so the sweep's own (record the run as interrupted) stays.
    """
    done = threading.Event()
    failure: list[BaseException] = []

    def target() -> None:
        try:
            init_ray(address)
        except BaseException as exc:  # handed to the waiting thread
            failure.append(exc)
        done.set()
        if not failure:
            threading.Event().wait()  # park: Ray's processes live as long as this thread

    threading.Thread(target=target, name="ray-init", daemon=True).start()

    def wait() -> None:
        done.wait()
        if failure:
            raise failure[0]
        python_sigterm()

    return wait


# --------------------------------------------------------------------------- shared storage (NFS path or s3:// gs:// URI)


def is_uri(path: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+.-]*://", path) is not None


def storage_join(base: str, *parts: str) -> str:
    """`base/part/...` for a local path or a URI (no normalisation of the scheme's slashes)."""
    return "/".join([base.rstrip("/"), *parts])


def _filesystem(target: str) -> tuple[Any, str]:
    import pyarrow.fs

    if is_uri(target):
        try:
            return pyarrow.fs.FileSystem.from_uri(target)
        except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for unknown schemes or credentials
            raise ConfigError(f"cannot open storage {target!r}: {exc}; check the URI and the credentials of this node") from exc
    return pyarrow.fs.LocalFileSystem(), target


def check_storage(target: str) -> None:
    """sweep.storage_path reachable before any work: one metadata request (a URI that cannot be reached, or whose
    credentials are refused, ends the command here instead of after the preparation)."""
    if not is_uri(target):
        return
    fs, root = _filesystem(target)
    try:
        fs.get_file_info(root)
    except Exception as exc:  # OSError from the S3 / GCS client: unknown host, refused connection, denied access
        first = str(exc).splitlines()[0][:240] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"sweep.storage_path={target} cannot be reached ({first}); check the URI, the network and this node's credentials"
        ) from None


def mirror_files(local_dir: Path, names: Sequence[str], target: str) -> None:
    """Copy the files `names` of `local_dir` that exist to `target` (path or URI), each written then renamed."""
    import pyarrow.fs

    fs, root = _filesystem(target)
    fs.create_dir(root, recursive=True)
    for name in names:
        src = local_dir / name
        if not src.is_file():
            continue
        tmp = f"{root}/.{name}.tmp{os.getpid()}"
        pyarrow.fs.copy_files(str(src), tmp, source_filesystem=pyarrow.fs.LocalFileSystem(), destination_filesystem=fs)
        fs.move(tmp, f"{root}/{name}")


def fetch_dir(source: str, local_dir: Path) -> bool:
    """Copy the files directly under `source` (path or URI) into `local_dir`; False when `source` holds nothing."""
    import pyarrow.fs

    fs, root = _filesystem(source)
    info = fs.get_file_info(pyarrow.fs.FileSelector(root, allow_not_found=True))
    files = [f for f in info if f.type == pyarrow.fs.FileType.File and not f.base_name.startswith(".")]
    if not files:
        return False
    local_dir.mkdir(parents=True, exist_ok=True)
    local = pyarrow.fs.LocalFileSystem()
    for f in files:
        pyarrow.fs.copy_files(f.path, str(local_dir / f.base_name), source_filesystem=fs, destination_filesystem=local)
    return True
