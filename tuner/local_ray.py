"""Where a study's workers run: a Ray cluster the user names, kept as it is, or a private local Ray.

A cluster named with ``--address`` (or ``RAY_ADDRESS``) is joined with the user's own settings: kvtune
changes nothing about its addresses or its authentication.

Otherwise kvtune starts a Ray of its own (:func:`start_local_ray`, never an existing local cluster that
``ray.init()`` would find), and keeps it to this machine's loopback interface:

- every listener (GCS, raylet and its object manager, the runtime-env agent, each worker's and the driver's
  gRPC server) binds to 127.0.0.1: Ray's servers bind to loopback exactly when the node's address is
  ``127.0.0.1``, and ``ray.init`` would otherwise replace that address with the machine's outward-facing one
  (``services.resolve_ip_for_localhost``; Ray keeps loopback only where clusters are disabled, its setting
  for Windows and macOS, which is what :func:`start_local_ray` selects while Ray starts);
- no dashboard, no dashboard agent, no metrics exporter and no Ray Client server are started;
- Ray's token authentication stays on (Ray >= 2.5x turns it on for a new local cluster when
  ``RAY_AUTH_MODE`` is unset, and writes the token to ``~/.ray/auth_token`` if there is none): another
  local user who reaches a port still cannot run code without the token, and a token file that other users
  could read is made readable by its owner only (:func:`_protect_token`). An explicit
  ``RAY_AUTH_MODE=disabled`` in the environment is respected (the test suite sets it for itself) and said.

After Ray starts, its node address is checked: if it is not loopback (a Ray version that resolves it
another way), Ray is shut down and the study refused, rather than run reachable from the network.

Its workers import the kvtune the driver imported, whatever folder the driver runs from: Ray puts the
driver's working folder first on each worker's ``sys.path``, where a folder named ``kvtune`` (a clone, from
its parent) would shadow the installed package; each worker process therefore first loads ``kvtune`` from
the driver's package file (:func:`worker_runtime_env`), and every later ``import kvtune...`` finds it loaded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
AUTH_ENV = "RAY_AUTH_MODE"
ADDRESS_ENV = "RAY_ADDRESS"


class PrivateRayError(ValueError):
    """The local Ray could not be kept private (its node address is not loopback, or auth is off)."""


def init_ray(address: str | None) -> tuple[bool, list[str]]:
    """Connect to ``address`` (or ``RAY_ADDRESS``) as the user set it up, or start a private local Ray.

    Returns whether this call started Ray (the caller shuts it down) and notes for the console."""
    import ray

    if ray.is_initialized():
        return False, []
    target = address or os.environ.get(ADDRESS_ENV) or None
    if target is not None:
        ray.init(address=target, logging_level=logging.ERROR, log_to_driver=False)
        return True, [f"Ray cluster at {target}: its own network and authentication settings apply"]
    return True, start_local_ray()


def start_local_ray(**init_kwargs: Any) -> list[str]:
    """Start a new local Ray, every listener on 127.0.0.1 and token authentication on (see the module
    docstring); ``init_kwargs`` go to ``ray.init`` (resources, CPUs, ...). Returns notes for the console."""
    import ray
    from ray._private import ray_constants

    notes = []
    if os.environ.get(AUTH_ENV, "").lower() == "disabled":
        notes.append(
            f"{AUTH_ENV}=disabled: the local Ray runs without token authentication (it listens on "
            f"{LOOPBACK} only, so only users of this machine can reach it)"
        )
    options: dict[str, Any] = {
        "include_dashboard": False,
        "logging_level": logging.ERROR,
        "log_to_driver": False,
        "runtime_env": worker_runtime_env(),
    }
    options |= init_kwargs
    keep = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # while Ray starts: keep 127.0.0.1 as the node's address
    try:
        ray.init(address="local", _node_ip_address=LOOPBACK, **options)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = keep
    try:
        _check_private()
    except PrivateRayError:
        ray.shutdown()
        raise
    return notes + _protect_token()


def worker_runtime_env() -> dict[str, Any]:
    """The runtime env of the local Ray's jobs: each worker process loads the driver's kvtune first."""
    import kvtune

    return {"worker_process_setup_hook": _loader_of(str(Path(kvtune.__file__).resolve()))}


def _loader_of(init_file: str) -> Callable[[], None]:
    """A function that loads the package ``kvtune`` from ``init_file`` (its ``__init__.py``) unless it is
    already loaded. Defined inside this function, it is sent to the workers by value: calling it imports
    nothing of kvtune by name, so no folder on the worker's ``sys.path`` can shadow it."""

    def load_kvtune() -> None:
        import importlib.util
        import os
        import sys

        loaded = getattr(sys.modules.get("kvtune"), "__file__", None)
        if loaded is not None and os.path.realpath(loaded) == init_file:
            return
        spec = importlib.util.spec_from_file_location("kvtune", init_file)
        assert spec is not None and spec.loader is not None, f"no module spec for {init_file}"
        module = importlib.util.module_from_spec(spec)
        sys.modules["kvtune"] = module
        spec.loader.exec_module(module)

    return load_kvtune


def node_address() -> str:
    """The address this process's Ray node listens on."""
    import ray

    node: Any = ray._private.worker.global_worker.node
    return str(node.node_ip_address)


def auth_mode() -> str:
    """``"token"`` or ``"disabled"`` as the running Ray sees it (``"unsupported"`` before token auth)."""
    import ray._raylet as raylet

    if not hasattr(raylet, "get_authentication_mode"):
        return "unsupported"
    token: Any = getattr(raylet, "AuthenticationMode").TOKEN  # noqa: B009 (absent from Ray's stubs)
    return "token" if raylet.get_authentication_mode() == token else "disabled"


def token_path() -> Path:
    """Where Ray reads its token from (``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``)."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def _protect_token() -> list[str]:
    """Ray writes its token file with the default umask (often readable by every user of the machine); a
    token file of this user that others can read is made readable by its owner only, and said."""
    if auth_mode() != "token" or os.environ.get("RAY_AUTH_TOKEN"):
        return []
    path = token_path()
    try:
        st = path.stat()
        if st.st_uid != os.getuid() or not st.st_mode & 0o077:
            return []
        path.chmod(0o600)
    except OSError:
        return []
    return [f"{path}: Ray's token was readable by other users (mode {st.st_mode & 0o777:04o}); now 0600"]


def _check_private() -> None:
    address = node_address()
    if address != LOOPBACK:
        raise PrivateRayError(
            f"the local Ray started on {address}, not {LOOPBACK}: this Ray version would listen beyond this "
            "machine, so the study is not run; start a cluster yourself and pass --address"
        )
    explicit = os.environ.get(AUTH_ENV, "").lower()
    if auth_mode() == "disabled" and explicit != "disabled":
        raise PrivateRayError(
            f"the local Ray started without token authentication; set {AUTH_ENV}=token (or "
            f"{AUTH_ENV}=disabled to run without it on {LOOPBACK})"
        )
