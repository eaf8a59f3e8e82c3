"""The console's web server (aiohttp + jinja2, server-rendered; live through server-sent events).

    GET  /                     the fleet: counts, by model/version, the device table
    GET  /device/<id>          one device: charts, snapshot, classes, events
    GET  /deployments[/<job>]  jobs, waves, per-device states, canary p95, timeline; the deploy form
    POST /actions/deploy|cancel|rollback   (operator, CSRF token)
    GET  /events               server-sent events: "changed" after every write, "health"
    GET  /fragment/<page>      the live part of a page, re-rendered (what the events fetch)
    GET  /metrics              Prometheus text
    GET  /login, POST /login, POST /logout

Every string a device sends reaches a page through jinja2's autoescape (or JSON the page's script
puts in as text), never as markup.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
from aiohttp import web

from ..client import Fleet, FleetError
from . import actions
from . import queries as Q
from .auth import Auth, Session
from .ingest import Ingest
from .metrics import prometheus
from .store import Store, StoreError

log = logging.getLogger("tandoor.console")
HERE = Path(__file__).parent
SESSION_COOKIE = "tandoor_console"
UPLOAD_MAX = 512 * 1024 * 1024
SSE_MIN_GAP_S = 0.3
SSE_HEARTBEAT_S = 15.0


def _age(ts: float | None, now: float | None = None) -> str:
    if ts is None:
        return "never"
    s = max(0.0, (now or time.time()) - float(ts))
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _clock(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _num(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{float(v):.{digits}f}"


class Console:
    """The web app around a Store and an Ingest; ``broker``/``cafile``/``prefix`` for the actions."""

    def __init__(self, store: Store, ingest: Ingest | None, auth: Auth, broker: str, cafile: str | None = None,
                 prefix: str = "tandoor", bundles_dir: Path | None = None) -> None:
        self.store, self.ingest, self.auth = store, ingest, auth
        self.broker, self.cafile, self.prefix = broker, cafile, prefix
        self.bundles_dir = bundles_dir
        self.upload_dir = Path(tempfile.mkdtemp(prefix="tandoor-console-uploads-"))
        self.env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                                      autoescape=True, undefined=jinja2.ChainableUndefined)
        self.env.filters.update(age=_age, clock=_clock, num=_num, tojson_attr=lambda v: json.dumps(v))
        self.version = 0
        self._cond: asyncio.Condition | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.running: dict[str, threading.Thread] = {}
        if ingest is not None:
            ingest.on_change.append(self._changed_threadsafe)

    # ---------------------------------------------------------------------- live updates
    def _changed_threadsafe(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._bump()))
            except RuntimeError:    # closed between the check and the call: the server is stopping
                pass

    async def _bump(self) -> None:
        self.version += 1
        async with self._cond:
            self._cond.notify_all()

    async def _on_startup(self, app) -> None:
        self._loop = asyncio.get_running_loop()
        self._cond = asyncio.Condition()

    def health(self) -> dict:
        h = self.ingest.health() if self.ingest is not None else {"brokers": [], "stale_since": None, "counters": {}}
        h["db_error"] = self.store.write_error
        h["db_error_since"] = self.store.write_error_since
        return h

    # ---------------------------------------------------------------------- app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=UPLOAD_MAX, middlewares=[self._guard])
        app.on_startup.append(self._on_startup)
        r = app.router
        r.add_get("/", self.fleet_page)
        r.add_get("/device/{dev}", self.device_page)
        r.add_get("/device/{dev}/series.json", self.device_series)
        r.add_get("/device/{dev}/snapshot.jpg", self.device_snapshot)
        r.add_get("/deployments", self.jobs_page)
        r.add_get("/deployments/{job}", self.job_page)
        r.add_get("/fragment/", self.fleet_fragment)
        r.add_get("/fragment/device/{dev}", self.device_fragment)
        r.add_get("/fragment/deployments", self.jobs_fragment)
        r.add_get("/fragment/deployments/{job}", self.job_fragment)
        r.add_get("/events", self.events)
        r.add_get("/metrics", self.metrics)
        r.add_get("/login", self.login_page)
        r.add_post("/login", self.login)
        r.add_post("/logout", self.logout)
        r.add_post("/actions/deploy", self.act_deploy)
        r.add_post("/actions/cancel", self.act_cancel)
        r.add_post("/actions/rollback", self.act_rollback)
        r.add_static("/static", HERE / "static")
        return app

    # ---------------------------------------------------------------------- auth
    def _session(self, request) -> Session | None:
        return self.auth.session(request.cookies.get(SESSION_COOKIE))

    @web.middleware
    async def _guard(self, request, handler):
        request["session"] = self._session(request)
        request["user"] = request["session"].user if request["session"] else None
        authz = request.headers.get("Authorization", "")
        if request["user"] is None and authz.startswith("Bearer "):
            request["user"] = self.auth.bearer(authz[7:].strip())
        open_paths = ("/login", "/static/")
        if self.auth.enabled and request["user"] is None and not request.path.startswith(open_paths):
            if request.method == "GET" and not request.path.startswith(("/fragment", "/events", "/metrics")) \
                    and not request.path.endswith((".json", ".jpg")):
                raise web.HTTPFound("/login")
            raise web.HTTPUnauthorized(text="log in first (or send Authorization: Bearer TOKEN)")
        try:
            resp = await handler(request)
        except web.HTTPException:
            raise
        except StoreError as e:
            log.error("%s", e)
            return self.render(request, "error.html", status=503, message=str(e))
        except Exception as e:  # noqa: BLE001 (a page that fails is a log line and an error page)
            log.error("%s %s failed: %s: %s", request.method, request.path[:200], type(e).__name__, e)
            return self.render(request, "error.html", status=500, message=f"this page failed: {type(e).__name__}: {e}")
        resp.headers.setdefault("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; "
                                "style-src 'self' 'unsafe-inline'; script-src 'self'; frame-ancestors 'none'")
        resp.headers.setdefault("X-Content-Type-Options", "nosniff")
        resp.headers.setdefault("Referrer-Policy", "same-origin")
        return resp

    def _operator(self, request) -> Session:
        """The session of an operator whose form carried its CSRF token; 403 otherwise."""
        if not self.auth.enabled:
            raise web.HTTPForbidden(text="actions are off: start the console with --users FILE (operator logins)")
        s = request["session"]
        if s is None or s.user.role != "operator":
            raise web.HTTPForbidden(text="this needs an operator login")
        return s

    async def _form(self, request) -> dict:
        s = self._operator(request)
        form = await request.post()
        if form.get("csrf") != s.csrf:
            raise web.HTTPForbidden(text="the form's CSRF token is missing or stale: reload the page")
        return form

    # ---------------------------------------------------------------------- rendering
    def render(self, request, template: str, status: int = 200, **ctx) -> web.Response:
        s = request.get("session")
        user = request.get("user")
        html = self.env.get_template(template).render(
            user=user, csrf=s.csrf if s else "", auth=self.auth.enabled, health=self.health(), now=time.time(),
            can_act=bool(self.auth.enabled and user is not None and user.role == "operator"), **ctx)
        return web.Response(text=html, content_type="text/html", status=status)

    async def _q(self, fn, *args, **kw):
        """A query on a worker thread (the store's connections are per thread)."""
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(self.store, *args, **kw))

    def _table_args(self, request) -> dict:
        g = request.query
        try:
            page = int(g.get("page", "1"))
            size = min(max(int(g.get("n", Q.PAGE_SIZE)), 10), Q.PAGE_MAX)
        except ValueError:
            page, size = 1, Q.PAGE_SIZE
        return {"q": g.get("q", "")[:200], "sort": g.get("sort", "device_id"), "desc": g.get("desc") == "1",
                "page": page, "page_size": size}

    async def _fleet_ctx(self, request) -> dict:
        return {"table": await self._q(Q.devices_table, **self._table_args(request)),
                "fleet": await self._q(Q.fleet_counts), "columns": Q.COLUMNS}

    async def fleet_page(self, request):
        return self.render(request, "fleet.html", page="fleet", **await self._fleet_ctx(request))

    async def fleet_fragment(self, request):
        return self.render(request, "fleet_live.html", **await self._fleet_ctx(request))

    async def _device_ctx(self, request) -> dict:
        dev = request.match_info["dev"]
        d = await self._q(Q.device, dev)
        if d is None:
            raise web.HTTPNotFound(text="no such device in the database")
        snap = await self._q(Q.snapshot, dev)
        return {"d": d, "dev": dev, "classes": await self._q(Q.classes, dev), "events": await self._q(Q.events, dev),
                "result": await self._q(Q.latest_result, dev),
                "snap": {"ts": snap[1], "detections": snap[2]} if snap else None}

    async def device_page(self, request):
        return self.render(request, "device.html", page="device", **await self._device_ctx(request))

    async def device_fragment(self, request):
        return self.render(request, "device_live.html", **await self._device_ctx(request))

    async def device_series(self, request):
        rng = request.query.get("range", "hour")
        return web.json_response(await self._q(Q.series, request.match_info["dev"], rng if rng in Q.RANGES else "hour"))

    async def device_snapshot(self, request):
        snap = await self._q(Q.snapshot, request.match_info["dev"])
        if snap is None:
            raise web.HTTPNotFound(text="no snapshot from this device yet")
        return web.Response(body=snap[0], content_type="image/jpeg", headers={"Cache-Control": "no-store"})

    async def _jobs_ctx(self, request) -> dict:
        bundles = sorted(p.name for p in self.bundles_dir.glob("*.hmod")) if self.bundles_dir else []
        return {"jobs": await self._q(Q.jobs), "bundles": bundles}

    async def jobs_page(self, request):
        return self.render(request, "deployments.html", page="deployments", **await self._jobs_ctx(request))

    async def jobs_fragment(self, request):
        return self.render(request, "deployments_live.html", **await self._jobs_ctx(request))

    async def _job_ctx(self, request) -> dict:
        j = await self._q(Q.job, request.match_info["job"])
        if j is None:
            raise web.HTTPNotFound(text="no such job in the database")
        return {"j": j}

    async def job_page(self, request):
        return self.render(request, "job.html", page="deployments", **await self._job_ctx(request))

    async def job_fragment(self, request):
        return self.render(request, "job_live.html", **await self._job_ctx(request))

    # ---------------------------------------------------------------------- events, metrics
    async def events(self, request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        seen = -1
        last_health = None
        last_write = time.monotonic()
        try:
            while True:
                # a browser that left the page: end, so its connection does not count against the
                # browser's few connections per host (queued page loads and form posts behind it)
                if request.transport is None or request.transport.is_closing():
                    break
                if time.monotonic() - last_write > SSE_HEARTBEAT_S:
                    await resp.write(b": keep-alive\n\n")
                    last_write = time.monotonic()
                h = self.health()
                hs = json.dumps({"stale_since": h["stale_since"], "db_error": h["db_error"],
                                 "brokers": [(b["name"], b["connected"]) for b in h["brokers"]]})
                if self.version != seen:
                    seen = self.version
                    await resp.write(f"event: changed\ndata: {seen}\n\n".encode())
                    last_write = time.monotonic()
                if hs != last_health:
                    last_health = hs
                    await resp.write(f"event: health\ndata: {hs}\n\n".encode())
                async with self._cond:
                    try:
                        await asyncio.wait_for(self._cond.wait(), 1.0)
                    except asyncio.TimeoutError:
                        pass
                await asyncio.sleep(SSE_MIN_GAP_S)   # coalesce bursts: at most ~3 refreshes a second
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return resp

    async def metrics(self, request):
        m = await self._q(Q.metrics)
        return web.Response(text=prometheus(m, self.health(), self.ingest), content_type="text/plain",
                            charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})

    # ---------------------------------------------------------------------- login
    async def login_page(self, request):
        return self.render(request, "login.html", page="login", error=None)

    async def login(self, request):
        form = await request.post()
        got = self.auth.login(str(form.get("name", "")), str(form.get("secret", "")))
        if got is None:
            log.warning("a failed login for %r from %s", str(form.get("name", ""))[:100], request.remote)
            return self.render(request, "login.html", page="login", status=401, error="wrong name or password")
        sid, _ = got
        resp = web.HTTPFound("/")
        resp.set_cookie(SESSION_COOKIE, sid, httponly=True, samesite="Strict", max_age=12 * 3600)
        raise resp

    async def logout(self, request):
        s = request["session"]
        form = await request.post()
        if s is not None and form.get("csrf") == s.csrf:
            self.auth.logout(request.cookies.get(SESSION_COOKIE))
        resp = web.HTTPFound("/login")
        resp.del_cookie(SESSION_COOKIE)
        raise resp

    # ---------------------------------------------------------------------- actions
    def _fleet(self) -> Fleet:
        return Fleet(self.broker, cafile=self.cafile, prefix=self.prefix).connect()

    async def act_deploy(self, request):
        form = await self._form(request)
        who = f"the console ({request['session'].user.name})"
        up = form.get("bundle_file")
        if getattr(up, "file", None) is not None and getattr(up, "filename", ""):
            # a name of our own (the sender's may be "..", or anything): a fresh folder per upload
            name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(up.filename).name).lstrip(".") or "bundle.hmod"
            path = Path(tempfile.mkdtemp(dir=self.upload_dir)) / name
            path.write_bytes(up.file.read())
        elif form.get("bundle") and self.bundles_dir:
            path = self.bundles_dir / Path(str(form["bundle"])).name
            if not path.is_file():
                raise web.HTTPBadRequest(text=f"no bundle {path.name} in {self.bundles_dir}")
        else:
            raise web.HTTPBadRequest(text="give a bundle: upload one or pick a known one")
        devices = [d.strip() for d in str(form.get("devices", "")).split(",") if d.strip()] or None
        opts: dict[str, Any] = {}
        try:
            opts["canary_pct"] = float(str(form.get("canary") or "0").rstrip("%"))
            opts["max_failures"] = int(form.get("max_failures") or 0)
            if form.get("latency_budget_ms"):
                opts["latency_budget_ms"] = float(form["latency_budget_ms"])
            opts["timeout"] = float(form.get("timeout") or 600)
            opts["wave_size"] = int(form.get("wave_size") or 0)
        except ValueError as e:
            raise web.HTTPBadRequest(text=f"a deploy option is not a number: {e}") from None

        def start() -> str:
            f = self._fleet()
            try:
                r = actions.prepare(f, path, devices, self.store, who, **opts)
            except BaseException:
                f.close()
                raise
            job_id = r.planned.job_id

            def go():
                try:
                    actions.run(r, self.store)
                except Exception as e:  # noqa: BLE001 (a thread's failure is a log line)
                    log.error("deploy %s failed: %s: %s", job_id, type(e).__name__, e)
                finally:
                    f.close()
                    self.running.pop(job_id, None)
            t = self.running[job_id] = threading.Thread(target=go, daemon=True, name=f"deploy-{job_id}")
            t.start()
            return job_id
        try:
            job_id = await asyncio.get_running_loop().run_in_executor(None, start)
        except (FleetError, OSError) as e:
            return self.render(request, "error.html", status=400, message=f"the deploy did not start: {e}")
        log.info("deploy %s started by %s: %s", job_id, who, path.name)
        raise web.HTTPSeeOther(f"/deployments/{quote(job_id, safe='')}")

    async def act_cancel(self, request):
        form = await self._form(request)
        job = str(form.get("job", ""))
        who = f"the console ({request['session'].user.name})"

        def go():
            f = self._fleet()
            try:
                return actions.cancel(f, job, None, self.store, who)
            finally:
                f.close()
        try:
            out = await asyncio.get_running_loop().run_in_executor(None, go)
        except (FleetError, OSError) as e:
            return self.render(request, "error.html", status=400, message=f"cancel failed: {e}")
        log.info("cancel of job %s by %s: %s", job, who,
                 ", ".join(f"{d} {a.get('state')}" for d, a in out.items())[:500] or "no device runs it")
        raise web.HTTPSeeOther(f"/deployments/{quote(job, safe='')}")

    async def act_rollback(self, request):
        form = await self._form(request)
        devices = [d.strip() for d in str(form.get("devices", "")).split(",") if d.strip()]
        if not devices:
            raise web.HTTPBadRequest(text="name the devices to roll back")
        who = f"the console ({request['session'].user.name})"

        def go():
            f = self._fleet()
            try:
                return actions.rollback(f, devices, self.store, who, timeout=60)
            finally:
                f.close()
        t0 = time.monotonic()
        try:
            out = await asyncio.get_running_loop().run_in_executor(None, go)
        except (FleetError, OSError) as e:
            return self.render(request, "error.html", status=400, message=f"rollback failed: {e}")
        log.info("rollback of %s by %s: %s in %.1f s", ", ".join(devices)[:500], who,
                 ", ".join(f"{d} {'ok' if a.get('ok') else 'FAILED'}" for d, a in out.items())[:500], time.monotonic() - t0)
        raise web.HTTPSeeOther(f"/device/{quote(devices[0], safe='')}" if len(devices) == 1 else "/")
