"""Joining Ray: local by default, or an existing cluster by address, with one clear error when unreachable."""

from __future__ import annotations

import logging
import socket

from autocompress.errors import ConfigError


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


def init_ray(address: str | None) -> None:
    """Start local Ray (address None) or join the cluster at `address`; no-op if Ray is already up."""
    import ray

    if ray.is_initialized():
        return
    if address:
        check_ray_address(address)
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        except (ConnectionError, RuntimeError) as exc:
            raise ConfigError(f"could not join the Ray cluster at ray.address={address!r}: {exc}") from exc
    else:
        ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
