"""A fork server that runs on the emulated board: the board tests' commands without the emulator's
start-up cost per command.

Under qemu-user a fresh ``tandoor-agent`` process spends 10-20 s importing numpy, TVM's runtime,
onnxruntime, OpenCV and pyarmnn before it does anything. This script, started once per board
(``python3 forkserver.py SOCKET``, inside the board through scripts/board/run.sh), imports them
once and then serves requests on a Unix socket in the shared directory: one JSON line
``{"argv": [...], "env": {...}, "timeout": s}`` per connection, answered with one JSON line
``{"rc": n, "stdout": "...", "stderr": "...", "seconds": s}`` when the command ends.

Every command runs in a forked child of the warm process, as a fresh process of its own (its own
pid, environment, working directory /work, file descriptors 0-2, exit status, signals):

* ``tandoor-agent ARGS`` (by name or by the venv's path) runs ``tandoor_agent.cli.main`` as the
  console script does;
* ``python -c CODE ARGS`` runs CODE as ``__main__``;
* anything else is exec'd (a real new program: ``bash``, ``dpkg-query``...).

A child that outlives its ``timeout`` is killed (``rc`` -9, ``timed_out``). The server itself
forks a handler per connection, so commands may overlap. It only ever serves what the host test
sends through the shared directory; it is test infrastructure, not part of the agent.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import tempfile
import time

AGENT = "tandoor-agent"
PYTHONS = ("python", "python3")


def _warm() -> None:
    """What a tandoor-agent process imports before its first frame."""
    from tandoor_agent.run import lean

    lean.runtime_only()
    import numpy  # noqa: F401
    import tvm  # noqa: F401
    import tvm.runtime.vm  # noqa: F401

    for name in ("onnxruntime", "cv2", "pyarmnn", "paho.mqtt.client", "psutil", "PIL.Image"):
        try:
            __import__(name)
        except ImportError:
            pass    # the board may lack it on purpose (a blocked import): the command will say so
    for name in ("tandoor_agent.cli", "tandoor_agent.run.runtime", "tandoor_agent.serve.service"):
        try:
            __import__(name)
        except ImportError:
            pass    # the command imports it again and says what is missing


def _run_child(argv: list[str]) -> int:
    """Inside the forked child: become the command."""
    prog = os.path.basename(argv[0])
    if prog == AGENT:
        from tandoor_agent.cli import main

        sys.argv = [argv[0], *argv[1:]]
        try:
            main(args=argv[1:], prog_name=AGENT)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return 0
    if prog in PYTHONS and len(argv) >= 3 and argv[1] == "-c":
        sys.argv = ["-c", *argv[3:]]
        try:
            exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as e:
            if isinstance(e.code, int) or e.code is None:
                return e.code or 0
            print(e.code, file=sys.stderr)
            return 1
        return 0
    os.execvp(argv[0], argv)   # no return


def _handle(conn: socket.socket, base_env: dict[str, str]) -> None:
    """In a handler process: read the request, fork the command, wait, answer."""
    f = conn.makefile("rwb")
    req = json.loads(f.readline())
    argv, env, timeout = req["argv"], req.get("env") or {}, float(req.get("timeout") or 1200)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:   # the command's process
            rc = 1
            try:
                os.setsid()
                os.environ.clear()
                os.environ.update({**base_env, **env})
                os.chdir("/work")
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                conn.close()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                rc = _run_child(argv)
            except BaseException:   # what a real process prints for an uncaught exception
                import traceback

                traceback.print_exc()
                rc = 1
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(rc if isinstance(rc, int) else 1)
        timed_out = False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - t0 > timeout:
                timed_out = True
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                status = -signal.SIGKILL
                break
            time.sleep(0.05)
        rc = -signal.SIGKILL if timed_out else os.waitstatus_to_exitcode(status)
        secs = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        reply = {"rc": rc, "stdout": out.read().decode(errors="replace"), "stderr": err.read().decode(errors="replace"),
                 "seconds": round(secs, 3), "timed_out": timed_out}
    f.write((json.dumps(reply) + "\n").encode())
    f.flush()


def serve(path: str) -> None:
    _warm()
    base_env = dict(os.environ)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # wake select to reap handlers
    print(f"forkserver ready on {path} (pid {os.getpid()})", flush=True)
    with open(path + ".ready", "w") as f:
        f.write(str(os.getpid()))
    while True:
        try:
            while True:   # reap finished handlers
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
        except ChildProcessError:
            pass
        try:
            ready, _, _ = select.select([srv], [], [], 1.0)
        except InterruptedError:
            continue
        if not ready:
            continue
        conn, _ = srv.accept()
        if os.fork() == 0:
            srv.close()
            code = 0
            try:
                _handle(conn, base_env)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
