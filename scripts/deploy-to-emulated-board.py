"""Deploy a bundle over MQTT to the agent service on an emulated board, as a fleet would.

    .venv/bin/python scripts/deploy-to-emulated-board.py bookworm|trixie BUNDLE.hmod

The board (scripts/board/build.sh, as the board tests build it) runs `tandoor-agent` with a slot
seeded with BUNDLE as v1, against a mosquitto started here; the fleet's rollout then deploys it as
v2 (both re-signed with a fresh key), and the script prints what the device said: its NPU status,
the deploy's end state and the health gate's reason. A manual check of a real bundle on a board
(the board tests do the same with tiny models); the tests' helpers (tests/support) do the work."""
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from board.boards import EmulatedBoard
from support.agents import deploy, running_sha, seed_slots, write_config
from support.bundle_edit import rewrite, sha, version
from support.mosquitto import Broker, Recorder
from tandoor_contract import hmod

if len(sys.argv) != 3 or not Path(sys.argv[2]).is_file():
    sys.exit("usage: deploy-to-emulated-board.py bookworm|trixie BUNDLE.hmod")
name, bundle = sys.argv[1], Path(sys.argv[2])
tmp = Path(tempfile.mkdtemp(prefix=f"tandoor-deploy-{name}-"))
share = tmp / "share"
share.mkdir()
board = EmulatedBoard(name, share)
hmod.generate_keypair(tmp / "k.pem", tmp / "k.pub.pem")
v1, v2 = (rewrite(bundle, tmp / f"v{i}.hmod", version(str(i)), tmp / "k.pem") for i in (1, 2))
remote = board.mkdir()
here = share / Path(remote).name
shutil.copy2(tmp / "k.pub.pem", here / "k.pub.pem")
seed_slots(here / "slots", v1, tmp / "k.pub.pem")
broker = Broker(tmp / "broker").start()
write_config(here / "n1.toml", device_id="b1", slot_dir=f"{remote}/slots", trusted_keys=[f"{remote}/k.pub.pem"],
             delegate="auto", telemetry_period_s=2.0, results_max_rate_hz=1.0,
             broker={"host": "127.0.0.1", "port": broker.port, "reconnect_min_s": 0.5, "reconnect_max_s": 2.0},
             camera={"source": "synthetic:192x48@5"})
rec = Recorder(broker.port, "tandoor/#").start()
log = open(tmp / "agent.log", "wb")
t0 = time.time()
agent = subprocess.Popen(board.command([f"{board.venv}/bin/tandoor-agent", "--config", f"{remote}/n1.toml"]), stdout=log, stderr=subprocess.STDOUT)
try:
    st = running_sha(rec, "b1", sha(v1), 900)
    print(f"v1 running after {time.time()-t0:.0f}s; npu: {st['npu']}")
    t1 = time.time()
    res = deploy(broker.port, v2, ["b1"], job_id="npu-real", timeout=1800)
    print(f"deploy: {res['devices']['b1']['state']} in {time.time()-t1:.0f}s: {res['devices']['b1'].get('reason')}")
    if res["devices"]["b1"]["state"] == "committed":
        st = running_sha(rec, "b1", sha(v2), 300)
        print("v2 status npu:", st["npu"], [e["executor"] for e in st["executors"]])
finally:
    agent.send_signal(signal.SIGTERM)
    try:
        agent.wait(120)
    except subprocess.TimeoutExpired:
        agent.kill()
    rec.stop()
    broker.stop()
    board.close()
