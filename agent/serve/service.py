"""`tandoor-agent --config FILE` / `tandoor-agent serve --config FILE`: the agent's main loop.

    config -> MQTT link (will = offline) -> bundle (verified) -> HybridModule -> Pipeline -> camera
    loop:  commands -> watchdog -> latest frame -> pipeline.process -> telemetry.record per stage
           (+ per-class counts) -> snapshot (every snapshot.period_s) -> results (rate-limited)
           -> telemetry (every telemetry_period_s)
    SIGTERM/SIGINT: stop the camera, flush telemetry, publish status offline (retained), disconnect,
    exit 0.

systemd (Type=notify): READY=1 after the first inference, WATCHDOG=1 from the loop at half of
WATCHDOG_USEC (a loop stuck in inference or a dead lock stops pinging and gets restarted),
STOPPING=1 when draining, STATUS= lines along the way.

Faults the loop rides out: a camera that fails while running (unplugged, its file or folder
removed) is reopened with backoff (camera.Reconnecting) while the loop goes on (state
"camera-lost", the reason in status, watchdog fed, commands answered); a dead MQTT network thread
is replaced by the link itself. A dead link (its sender thread gone) ends the agent (exit 1) so
the service manager restarts it.

Exit codes: 0 stopped (signal, --max-frames, --duration, end of a non-looping source);
1 internal error; 2 bad config or command line; 3 runtime (no executor, inference keeps failing);
4 camera (cannot open at start); 10-19 bundle refused (contract/hmod.py's table).
Every failure is one line on stderr: "tandoor-agent: error: <reason>".
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from .. import failpoints
from . import commands
from . import config as config_mod
from .capture import Capture
from .config import Config, ConfigError
from tandoor_contract.errors import TandoorError
from tandoor_contract import durable

log = logging.getLogger("tandoor.service")

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
#: test failpoint: when this file exists, the next inference removes it and never returns (as a
#: wedged driver would); only the watchdog can tell, and systemd's restart recovers
HANG_ENV = "TANDOOR_SERVE_HANG_FILE"


class ServiceError(TandoorError):
    def __init__(self, msg: str, exit_code: int = 1) -> None:
        super().__init__(msg, exit_code=exit_code)


@functools.lru_cache(maxsize=1)
def agent_version() -> str:
    try:
        from importlib.metadata import version

        return version("tandoor")
    except Exception:
        return "0+unknown"


class Model:
    """An opened bundle made runnable: bundle + HybridModule + Pipeline, closed together.

    ``trust(slot)`` gives the keys to open a slot's bundle with and the sha256 it must have
    (trust is decided at install: the key that verified it then, for the bytes it verified), or
    raises when nothing can be trusted; without it, the config's trusted keys."""

    def __init__(self, cfg: Config, trust: Callable[[str | None], tuple[list, str | None]] | None = None) -> None:
        from tandoor_contract import hmod

        self.path, self.slot = config_mod.resolve_bundle(cfg)
        keys, want = trust(self.slot) if trust is not None else (cfg["trusted_keys"], None)
        sha = durable.sha256_file(self.path) if self.path.is_file() else None
        if want is not None and sha != want:
            raise hmod.HashMismatch(f"{self.path} is not the bundle slot {self.slot} installed (sha256 "
                                    f"{str(sha)[:16]}..., installed {want[:16]}...)")
        self.bundle = hmod.open_bundle(self.path, trusted_keys=keys)
        try:
            self.bundle.lib_for()
            m = self.bundle.manifest
            self.info = {"name": m["model"]["name"], "version": m["model"].get("version"), "sha256": sha}
            self.module = None
            self.pipeline = None
        except BaseException:
            self.bundle.close()
            raise

    def build(self, cfg: Config) -> Model:
        """The slow part (TVM import, executors): after the link is up, so status says 'starting'."""
        from .pipeline import Pipeline
        from ..run.runtime import HybridModule

        try:
            failpoints.hit("build", self.info["sha256"])
            self.module = HybridModule(self.bundle, delegate=cfg["delegate"],
                                       armnn_backends=tuple(cfg["armnn_backends"]),
                                       npu_cores=tuple(cfg["npu_cores"]))
            self.pipeline = Pipeline(self.module, self.bundle.manifest, top_k=cfg["top_k"],
                                     postprocessor=cfg["postprocess.decoder"],
                                     options=config_mod.decoder_overrides(cfg))
        except BaseException:
            self.close()
            raise
        return self

    def executors(self) -> list[dict]:
        if self.module is None:
            return []
        return [{"symbol": d["symbol"], "executor": d["executor"], "backend": d["backend"]}
                for d in self.module.describe()]

    def set_top_k(self, k: int) -> None:
        if self.pipeline is not None:
            self.pipeline.ctx.top_k = k

    def close(self) -> None:
        if self.module is not None:
            try:
                self.module.close()
            except Exception:
                pass
            self.module = None
        self.bundle.close()


def open_camera(cfg: Config):
    """The configured frame source (made, not started), with only the options its kind takes."""
    from . import camera

    spec = cfg["camera.source"]
    kind, _ = camera.parse_spec(spec)
    fps = cfg["camera.fps"] or None
    opts: dict[str, Any] = {}
    if kind in ("v4l2", "synthetic"):
        opts.update(width=cfg["camera.width"] or None, height=cfg["camera.height"] or None, fps=fps)
    elif kind == "file":
        opts.update(loop=cfg["camera.loop"], realtime=cfg["camera.realtime"], fps=fps)
    elif kind == "images":
        opts.update(loop=cfg["camera.loop"], fps=fps)
    elif kind == "gst":
        opts.update(fps=fps)
    return camera.open_source(spec, **opts)


class Service:
    """The agent's main loop (see the module docstring). ``run()`` returns the exit code."""

    def __init__(self, cfg: Config, max_frames: int | None = None, duration: float | None = None) -> None:
        from .sdnotify import Notifier, watchdog_interval

        self.cfg = cfg
        self.max_frames = max_frames
        self.duration = duration
        self.notifier = Notifier.from_env()
        self.watchdog_s = watchdog_interval()
        self.commands: queue.Queue = queue.Queue()
        self.t_start = time.monotonic()
        self.state = "starting"
        self.error: str | None = None
        self.model: Model | None = None
        self.source = None
        self.telemetry = None
        self.link = None
        self.frames = 0
        self.consecutive_errors = 0
        self._stop_reason: str | None = None
        self.updater = None
        self._pending_swap: tuple[Model, threading.Event] | None = None
        self._swap_lock = threading.Lock()  # hands a built model to the loop, or abandons it, never both
        self.swaps = 0
        self.snapshots = None  # snapshot.Snapshots, once the link exists
        self.capture = None    # capture.Capture while the capture command saves frames

    # ----------------------------------------------------------------------------- helpers
    def status(self) -> dict:
        s: dict[str, Any] = {"state": self.state, "uptime_s": round(time.monotonic() - self.t_start, 1),
                             "agent_version": agent_version()}
        if self.model is not None:
            s.update(model=self.model.info, slot=self.model.slot, bundle=str(self.model.path),
                     executors=self.model.executors())
            npu = self.model.module.npu() if self.model.module is not None else None
            if npu:
                s["npu"] = npu
            gpu = self.model.module.gpu() if self.model.module is not None else None
            if gpu:
                s["gpu"] = gpu
        if self.source is not None:
            s["camera"] = self.source.name
            lost = self.source.lost_info()
            if lost is not None:
                s["camera_lost"] = lost
        if self.error:
            s["error"] = self.error
        if self.updater is not None:
            if self.updater.notice:
                s["update"] = self.updater.notice  # e.g. a crash loop rolled back at this start
            if self.updater.recovered():
                s["recovered"] = self.updater.recovered()  # a damaged state.json or keyring, repaired
            if self.updater.store is not None:
                s["keyring"] = self.updater.keys.status()
        return s

    def request_stop(self, reason: str) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._stop_reason is None:
            log.info("%s: draining", name)
        self.request_stop(name)

    def _watchdog(self, now: float) -> None:
        if self.watchdog_s is not None and now - self._last_ping >= self.watchdog_s:
            self.notifier.watchdog()
            self._last_ping = now

    # ---------------------------------------------------------------------------- commands
    def _handle(self, req) -> None:
        """Run a command from commands.COMMANDS and answer it (now, or later for capture and
        rollback); any refusal is an ``ok: false`` answer with one line."""
        cmd, args = req.cmd, req.args
        try:
            spec = commands.COMMANDS.get(cmd)
            if spec is None:
                raise ConfigError(commands.unknown(cmd))
            if spec.needs_slots and (self.updater is None or self.updater.store is None):
                raise ConfigError(f"{cmd} needs slot_dir (this agent serves an explicit bundle)")
            result = getattr(self, spec.handler)(req, args)
            if result is commands.ANSWERED_LATER:
                return
        except Exception as err:
            msg = " ".join(str(err).split()) or type(err).__name__
            log.warning("command %s refused: %s", cmd, msg)
            self.link.respond(req, ok=False, error=msg)
            return
        self.link.respond(req, ok=True, result=result)

    def _cmd_ping(self, req, args) -> dict:
        return {"pong": True, "state": self.state, "uptime_s": round(time.monotonic() - self.t_start, 1),
                "frames": self.frames}

    def _cmd_get_config(self, req, args) -> dict:
        return self.cfg.as_dict(redact=True)

    def _cmd_set_config(self, req, args) -> dict:
        if not args:
            raise ConfigError(f"set-config needs args {{key: value}}; safe keys: {', '.join(config_mod.SAFE_KEYS)}")
        result = self.cfg.set_safe_many(args)  # all or nothing
        if "top_k" in result and self.model is not None:
            self.model.set_top_k(result["top_k"])
        if "telemetry_period_s" in result:
            self._next_tel = min(self._next_tel, time.monotonic() + result["telemetry_period_s"])
        return result

    def _cmd_reload(self, req, args) -> dict:
        return self._reload()

    def _cmd_snapshot(self, req, args) -> dict:
        result = self.snapshots.send() if self.snapshots is not None else None
        if result is None:
            raise ServiceError("no snapshot: no frame processed yet, or the broker is not connected")
        result["topic"] = self.link.topic["snapshot"]
        return result

    def _cmd_capture(self, req, args):
        if self.capture is not None:
            raise ServiceError(f"busy: capture {self.capture.id} is running ({len(self.capture.files)} of "
                               f"{self.capture.frames} frames); ask again when it has answered")
        root = Path(self.cfg["capture_dir"] or Path(self.cfg["slot_dir"]) / "captures")
        self.capture = Capture.start(root, args, req)
        log.info("capture %s: saving %d frame(s) to %s", self.capture.id, self.capture.frames, self.capture.root)
        return commands.ANSWERED_LATER   # answered when the frames are written (_end_capture)

    def _cmd_update_status(self, req, args) -> dict:
        return {"busy": self.updater.busy, "slots": self.updater.store.status(),
                "counters": dict(self.updater.counters), "deadlines": self.updater.deadlines.status(),
                "keyring": self.updater.keys.status(), "recovered": self.updater.recovered()}

    def _cmd_rollback(self, req, args):
        # off the loop: the new model is built in the background and swapped in
        threading.Thread(target=self._rollback_cmd, args=(req, args), daemon=True).start()
        return commands.ANSWERED_LATER

    def _end_capture(self, why: str | None = None) -> None:
        """Answer the capture request with what it saved (an error when nothing was)."""
        cap, self.capture = self.capture, None
        if why and not cap.stopped and len(cap.files) < cap.frames:
            cap.stopped = why
        if not cap.files:
            try:
                cap.root.rmdir()
            except OSError:
                pass
            log.warning("capture %s saved nothing: %s", cap.id, cap.stopped)
            self.link.respond(cap.req, ok=False, error=f"capture {cap.id} saved no frame: {cap.stopped}")
            return
        log.info("capture %s: %d frame(s) in %s%s", cap.id, len(cap.files), cap.root,
                 f" (stopped: {cap.stopped})" if cap.stopped else "")
        self.link.respond(cap.req, ok=True, result=cap.result())

    def _reload(self) -> dict:
        """Re-open the bundle (the committed slot may have changed). On failure the running model
        stays (and the error is the response)."""
        old = self.model
        self.notifier.status("reloading the bundle")
        new = Model(self.cfg, self._trust).build(self.cfg)  # closes itself when it fails
        self.model = new
        if self.telemetry is not None:
            self.telemetry.reset_latency()
        if old is not None:
            old.close()
        self.link.set_identity(model=new.info, slot=new.slot)
        self.link.publish_status(self.status())
        self.notifier.status(f"running {new.info['name']} v{new.info['version']}")
        log.info("reloaded %s (%s)", new.path, new.info["sha256"][:12])
        return {"model": new.info, "slot": new.slot, "bundle": str(new.path), "executors": new.executors()}

    # ------------------------------------------------------------------ updates (hot swap)
    def _make_updater(self):
        """The update job handler (agent/update/jobs.py); with slot_dir it first recovers the slots
        (a trial left uncommitted is rolled back and reported once connected)."""
        from ..update.jobs import Updater
        from ..update.slots import StateCorrupt

        from ..update.deadlines import Deadlines

        cfg = self.cfg
        store = None
        if not cfg["bundle"]:
            from ..update.slots import SlotStore

            store = SlotStore(cfg["slot_dir"], cfg["trusted_keys"])
        up = Updater(store, cfg.topic_base, self.link.publish_raw, trusted_keys=cfg["trusted_keys"],
                     delegate=cfg["delegate"], swap=self._swap_committed, device_id=cfg["device_id"],
                     subscribe=self.link.subscribe_raw, unsubscribe=self.link.unsubscribe_raw,
                     served=lambda: self.frames,
                     deadlines=Deadlines(cfg["update.health_timeout_s"], cfg["update.swap_timeout_s"]))
        try:
            for note in up.recover():
                log.warning("update recovery: %s", note)
        except StateCorrupt:
            raise  # nothing safe to serve: one line saying how to repair
        except Exception as err:
            log.error("slot recovery failed: %s", " ".join(str(err).split()))
        return up

    def _trust(self, slot: str | None) -> tuple[list, str | None]:
        """The keys a bundle opens with and the sha256 it must have (see Model): a slot's
        bundle with the key that verified it at install; anything else with the keys trusted now,
        and nothing at all when keys are configured but none is trusted (fail closed)."""
        from tandoor_contract import hmod

        up = self.updater
        if up is not None and up.store is not None and slot is not None:
            t = up.store.install_trust(slot)
            if t is not None:
                return t
        why = up.keys.refusal() if up is not None else None
        if why:
            raise hmod.BadSignature(why)
        return self.cfg["trusted_keys"], None

    def _swap_committed(self, timeout: float = 120.0) -> None:
        """Called off the loop (updater thread): build the newly committed slot's model in a
        thread of its own, then let the loop swap the reference between two frames; returns
        once it serves. Past ``timeout`` (a library that never returns) it raises SwapTimeout
        and the model is abandoned: the loop never gets it, even if it finishes later."""
        from ..update.deadlines import WARMUP_RUNS
        from ..update.jobs import SwapTimeout

        deadline = time.monotonic() + timeout
        box: dict[str, Any] = {}
        abandoned = threading.Event()

        def build() -> None:
            try:
                new = Model(self.cfg, self._trust).build(self.cfg)  # closes itself when it fails
            except BaseException as e:
                box["error"] = e
                return
            try:
                new.pipeline.warmup(WARMUP_RUNS)  # first runs allocate and bind: here, not on the first served frame
            except BaseException as e:
                new.close()
                box["error"] = e
                return
            with self._swap_lock:
                if abandoned.is_set():
                    new.close()
                    log.warning("the hot swap given up at its deadline finished loading after all: discarded")
                    return
                box["done"] = threading.Event()
                self._pending_swap = (new, box["done"])

        t = threading.Thread(target=build, name="tandoor-swap-build", daemon=True)
        t.start()
        t.join(timeout)
        with self._swap_lock:
            if t.is_alive():
                abandoned.set()
                raise SwapTimeout(f"the committed model did not load within {timeout:g} s")
        if "error" in box:
            raise box["error"]
        if box["done"].wait(max(0.0, deadline - time.monotonic())):
            return
        with self._swap_lock:
            pending = self._pending_swap
            if pending is not None and pending[1] is box["done"]:  # the loop never took it
                self._pending_swap = None
                pending[0].close()
                raise SwapTimeout(f"the serving loop did not take the new model within {timeout:g} s")

    def _apply_swap(self) -> None:
        with self._swap_lock:
            pending, self._pending_swap = self._pending_swap, None
        if pending is None:
            return
        new, done = pending
        old, self.model = self.model, new
        self.swaps += 1
        if self.telemetry is not None:
            self.telemetry.reset_latency()  # the percentiles from here on are the new model's
        done.set()
        if old is not None:
            old.close()
        self.link.set_identity(model=new.info, slot=new.slot)
        self.link.publish_status(self.status())
        self.notifier.status(f"running {new.info['name']} v{new.info['version']}")
        log.info("hot swap: now serving %s v%s from slot %s (%s)", new.info["name"], new.info["version"],
                 new.slot, new.info["sha256"][:12])

    def _rollback_cmd(self, req, args) -> None:
        try:
            result = self.updater.rollback_committed(str(args.get("reason") or "rollback requested by the operator"))
        except Exception as err:
            self.link.respond(req, ok=False, error=" ".join(str(err).split()) or type(err).__name__)
            return
        self.link.respond(req, ok=True, result=result)

    def _drain_commands(self) -> None:
        while True:
            try:
                req = self.commands.get_nowait()
            except queue.Empty:
                return
            try:
                self._handle(req)
            except Exception as err:  # a bug in a command must not end the loop (respond never raises)
                log.exception("command %s failed", req.cmd)
                self.link.respond(req, ok=False, error=f"internal error: {' '.join(str(err).split())}")

    # ----------------------------------------------------------------------------- publish
    def _publish_telemetry(self) -> None:
        snap = self.telemetry.snapshot()
        snap["uptime_s"] = round(time.monotonic() - self.t_start, 1)
        if self.model is not None:
            snap["model"] = {k: self.model.info[k] for k in ("name", "version", "sha256")}
        snap["camera"] = self.source.stats() if self.source is not None else None
        snap["mqtt"] = self.link.stats()
        snap["state"] = self.state
        if self.updater is not None and self.updater.recovered():
            snap["recovered"] = self.updater.recovered()
        self.link.publish_telemetry(snap)

    def _publish_result(self, result) -> None:
        body = result.to_json()
        if isinstance(body, (str, bytes)):
            import json

            body = json.loads(body)
        body = dict(body)
        body.setdefault("ts", round(time.time(), 3))
        self.link.publish_result(body)

    # -------------------------------------------------------------------------------- run
    def run(self) -> int:
        from . import mqtt
        from ..telemetry import Telemetry

        cfg = self.cfg
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._last_ping = 0.0
        self.notifier.status("opening the bundle")
        self.link = mqtt.Link(cfg, on_command=self.commands.put, status=self.status)
        self.link.set_identity(agent_version=agent_version())
        from .snapshot import Snapshots

        self.snapshots = Snapshots(self.link.publish_snapshot, cfg["snapshot.period_s"], cfg["snapshot.quality"],
                                   connected=lambda: self.link.connected)
        self.updater = self._make_updater()
        self.link.updater = self.updater
        try:
            try:
                self.model = Model(cfg, self._trust)  # verified before anything from it is used
            except Exception as err:
                self._fail_early(err)
                raise
            self.link.set_identity(model=self.model.info, slot=self.model.slot)
            self.link.start()
            self.updater.start()
            self.notifier.status(f"loading {self.model.info['name']}")
            try:
                t0 = time.perf_counter()
                self.model.build(cfg)
                self.updater.deadlines.measured(time.perf_counter() - t0)  # sizes the gate's deadline
                self.telemetry = Telemetry(root=cfg["sysfs_root"], window=cfg["telemetry_window"])
                from .camera import Reconnecting

                self.source = Reconnecting(lambda: open_camera(cfg), cfg["camera.reconnect_min_s"],
                                           cfg["camera.reconnect_max_s"])
                self.source.start()
            except Exception as err:
                self.error = " ".join(str(err).split())
                raise
            code = self._loop()
        except BaseException as err:
            code = getattr(err, "exit_code", None)
            if not isinstance(code, int):
                code = 1
            if isinstance(err, KeyboardInterrupt):
                code = 0
            self.error = self.error or (" ".join(str(err).split()) or type(err).__name__)
            self._shutdown(reason="error" if code else "stopped")
            raise
        self._shutdown(reason="stopped" if code == 0 else "error")
        return code

    def _fail_early(self, err: BaseException) -> None:
        """The bundle was refused: say so on the status topic (retained) before exiting."""
        self.error = " ".join(str(err).split()) or type(err).__name__
        self.state = "error"
        try:
            self.link.start()
            deadline = time.monotonic() + 3.0
            while not self.link.connected and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:
            pass

    def _track_camera(self, ready: bool) -> None:
        """camera-lost while the source is being reopened, back to running when it works: the
        status says so (again at every failed attempt, which the backoff spaces out)."""
        src = self.source
        seen = (src.lost, src.attempts) if src.lost is not None else None
        if seen == self._camera_seen:
            return
        self._camera_seen = seen
        if seen is not None:
            self.state = "camera-lost"
            self.notifier.status(f"camera lost: {src.lost}")
        elif self.state == "camera-lost":
            self.state = "running" if ready else "starting"
            self.notifier.status(f"camera back: {src.name}")
        self.link.publish_status(self.status())

    def _hang_if_asked(self) -> None:
        path = os.environ.get(HANG_ENV)
        if path and os.path.exists(path):
            os.unlink(path)
            log.error("%s: this inference hangs (test failpoint)", HANG_ENV)
            while True:
                time.sleep(60)

    def _loop(self) -> int:
        from .camera import CameraError

        cfg = self.cfg
        tel, src = self.telemetry, self.source
        period_start = time.monotonic()
        self._next_tel = period_start + cfg["telemetry_period_s"]
        next_result = period_start
        deadline = (period_start + self.duration) if self.duration else None
        last_dropped = 0
        ready = False
        max_errors = cfg["max_consecutive_errors"]
        self._camera_seen = None
        hang_test = bool(os.environ.get(HANG_ENV))
        while self._stop_reason is None:
            now = time.monotonic()
            if not self.link.alive:
                raise ServiceError("the MQTT link stopped working (its sender thread died, see the log above); "
                                   "exiting so that the service manager restarts the agent")
            self._watchdog(now)
            if not self.commands.empty():
                self._drain_commands()
            if self.capture is not None and self.capture.tick():
                self._end_capture()
            if now >= self._next_tel:
                self._publish_telemetry()
                self._next_tel = max(self._next_tel + cfg["telemetry_period_s"], now)
            if deadline is not None and now >= deadline:
                self.request_stop("duration")
                break
            try:
                frame = src.latest(timeout=0.1)
            except CameraError as err:
                self.error = str(err)
                raise
            self._track_camera(ready)
            if frame is None:
                if src.eof:
                    log.info("the source ended")
                    self.request_stop("end of source")
                continue
            if self._pending_swap is not None:
                self._apply_swap()  # between two frames: the new model serves this one
            if hang_test:
                self._hang_if_asked()
            try:
                result = self.model.pipeline.process(frame)
            except Exception as err:
                tel.error()
                self.consecutive_errors += 1
                log.warning("frame %s failed: %s", frame.seq, " ".join(str(err).split()))
                if self.consecutive_errors >= max_errors:
                    raise ServiceError(f"{self.consecutive_errors} frames failed in a row; last: {err}", 3) from None
                continue
            self.consecutive_errors = 0
            for stage, seconds in result.timings.items():
                tel.record(stage, seconds)
            if result.outputs.get("kind") == "detector":  # per-class counts for telemetry
                tel.objects.add([d["label"] for d in result.outputs["detections"]])
            self.snapshots.offer(frame, result)
            if self.capture is not None and self.capture.offer(frame.image, frame.seq):
                self._end_capture()
            dropped = src.dropped
            tel.frame(dropped=dropped - last_dropped)
            last_dropped = dropped
            self.frames += 1
            if not ready:
                ready = True
                self.state = "running"
                msg = f"running {self.model.info['name']} v{self.model.info['version']} on {src.name}"
                self.notifier.ready(msg)
                self.link.publish_status(self.status())
                log.info("%s", msg)
            rate = cfg["results_max_rate_hz"]
            if rate > 0:
                now = time.monotonic()
                if now >= next_result:
                    self._publish_result(result)
                    next_result = max(next_result + 1.0 / rate, now)
            if self.max_frames is not None and self.frames >= self.max_frames:
                self.request_stop("max frames")
        return 0

    def _shutdown(self, reason: str) -> None:
        self.state = "stopped" if reason == "stopped" else "error"
        if self.capture is not None:
            self._end_capture(f"the agent stopped ({self._stop_reason or reason})")
        self.notifier.stopping(f"stopping ({self._stop_reason or reason})")
        if self.updater is not None:
            self.updater.stop()
        if self.source is not None:
            try:
                self.source.stop()
            except Exception as err:
                log.warning("camera stop failed: %s", err)
        if self.link is not None:
            if self.telemetry is not None and self.frames:
                try:
                    self._publish_telemetry()  # the last numbers, flushed below
                except Exception as err:
                    log.warning("final telemetry failed: %s", err)
            self.link.stop(reason=reason, status=self.status())
        if self.model is not None:
            self.model.close()
        self.notifier.close()
        log.info("stopped (%s) after %d frames", self._stop_reason or reason, self.frames)


# ---------------------------------------------------------------------------------------- CLI
def _setup_logging(level: str) -> None:
    lvl = getattr(logging, level.upper())
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    logging.getLogger("tandoor").setLevel(min(lvl, root.level or logging.WARNING))  # -v wins
    # paho logs connection failures at ERROR while it retries: ours say it once, in one line
    logging.getLogger("tandoor.mqtt.paho").setLevel(logging.DEBUG if lvl <= logging.DEBUG else logging.CRITICAL)


def _fail(err: BaseException) -> None:
    code = getattr(err, "exit_code", None)
    msg = " ".join(str(err).split()) or type(err).__name__
    if not isinstance(code, int):
        code, msg = 1, f"internal error ({type(err).__name__}): {msg}"
    click.echo(f"tandoor-agent: error: {msg}", err=True)
    sys.exit(code)


def run_service(config_path: Path, max_frames: int | None = None, duration: float | None = None,
                check: bool = False) -> int:
    try:
        cfg = config_mod.load(config_path)
    except ConfigError as err:
        _fail(err)
    if check:
        click.echo(f"{config_path}: ok")
        return 0
    _setup_logging(cfg["log_level"])
    svc = Service(cfg, max_frames=max_frames, duration=duration)
    try:
        return svc.run()
    except KeyboardInterrupt:
        return 0
    except Exception as err:
        if not isinstance(getattr(err, "exit_code", None), int):
            log.exception("internal error")
        _fail(err)
    return 1


@click.command("serve")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help=f"The agent's TOML config. Default: the group's --config, else {config_mod.DEFAULT_PATH}.")
@click.option("--max-frames", type=click.IntRange(1), help="Stop cleanly after this many processed frames.")
@click.option("--duration", type=click.FloatRange(0, min_open=True), help="Stop cleanly after this many seconds.")
@click.option("--check", is_flag=True, help="Only validate the config file, then exit (0: ok, 2: the bad key).")
@click.pass_context
def serve(ctx: click.Context, config_path: Path | None, max_frames: int | None, duration: float | None,
          check: bool) -> None:
    """Run the agent service: camera -> model -> results and telemetry over MQTT, commands from MQTT."""
    if config_path is None:
        parent = ctx.parent.params.get("config_path") if ctx.parent is not None else None
        config_path = Path(parent) if parent else Path(config_mod.DEFAULT_PATH)
    ctx.exit(run_service(config_path, max_frames, duration, check))


def main_callback(ctx: click.Context, config_path: Path | None) -> None:
    """For the `tandoor-agent` group (agent/cli.py): `tandoor-agent --config FILE` with no
    subcommand runs the service; with neither, the help."""
    if ctx.invoked_subcommand is not None:
        return
    if config_path is None:
        click.echo(ctx.get_help())
        ctx.exit(0)
    ctx.exit(run_service(Path(config_path)))


if __name__ == "__main__":
    serve()
