"""Test failpoints of the agent: ``TANDOOR_FAILPOINT=agent:<point>[=<action>][@<sha256 prefix>]``
(comma-separated for several), as compile's stages have them. Nothing happens without the
variable; production never sets it.

    point   where it fires (POINTS)
    action  raise (the default: a RuntimeError naming the point), hang (never returns, as a wedged
            driver call that released the GIL), crash (the process dies by SIGSEGV, as a native
            library does)
    @sha    only for the bundle whose file's sha256 starts so: a model that misbehaves, not the agent

Each point is where a native library would do it, so the code around it meets the fault as it
would meet the real one: ``build`` in the serving agent (at start, at the hot swap and at a
reload; not in the health gate's child, so a model can pass its gate and then fail in the
agent), ``health-load`` in the health gate's child process, ``run`` in ``tandoor-agent run``.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

ENV = "TANDOOR_FAILPOINT"
POINTS = ("build", "health-load", "run")
ACTIONS = ("raise", "hang", "crash")

log = logging.getLogger("tandoor.failpoint")


def _specs() -> list[tuple[str, str, str]]:
    """(point, action, sha prefix) of every agent failpoint in the environment."""
    out = []
    for spec in os.environ.get(ENV, "").split(","):
        spec = spec.strip()
        if not spec.startswith("agent:"):
            continue
        body, _, sha = spec[len("agent:"):].partition("@")
        point, _, action = body.partition("=")
        out.append((point, action or "raise", sha.lower()))
    return out


def hit(point: str, sha256: str | Callable[[], str] | None = None) -> None:
    """Fire the failpoint ``point`` if the environment arms it (for this bundle's ``sha256``,
    or a function that computes it: only called when a failpoint names a bundle)."""
    for p, action, prefix in _specs():
        if p != point:
            continue
        if prefix:
            sha = sha256() if callable(sha256) else sha256
            if not (sha or "").startswith(prefix):
                continue
        if action not in ACTIONS:
            raise ValueError(f"{ENV}: agent:{point}={action}: the actions are {', '.join(ACTIONS)}")
        if action == "raise":  # said by whoever reports the error
            raise RuntimeError(f"failpoint agent:{point}")
        log.error("%s=agent:%s=%s: %s here (test failpoint)", ENV, point, action,
                  "crashing" if action == "crash" else "hanging")
        if action == "crash":
            for h in logging.getLogger().handlers:
                h.flush()
            os.kill(os.getpid(), signal.SIGSEGV)
        while True:  # hang
            time.sleep(60)
