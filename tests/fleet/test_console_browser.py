"""The console in a real browser (Debian's chromium, headless, through chromium-driver and
selenium), one browser session for every check: mosquitto, `tandoor fleet console`, one real agent
(telemetry, snapshots), three simulated agents (scripts/fleet-sim.py: the real updater and slot
store) and a device with a hostile name. In the page: the rows and counts, a chart with points, a
snapshot that decodes, a device going offline within seconds without a reload, a deploy started
from the page reaching committed on every device, one from the CLI listed beside it, a rollback from
the device page answered within the wait, the hostile name shown as text. Screenshots go to ``$TANDOOR_SCREENSHOTS`` (default: the test's tmp dir)."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from support.agents import START_TIMEOUT, AgentProcess, agent_config, make_bundles, seed_slots
from support.cli import BIN, ROOT
from support.console import ConsoleProcess
from support.mosquitto import Broker, Recorder, available

pytestmark = pytest.mark.skipif(not available(), reason="mosquitto is not installed (apt install mosquitto)")

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
HOSTILE = '<img src=x onerror="window.__xss=1">'
TOKEN = "operator-token-0123456789abcdef"
SIMS = ["sim000", "sim001", "sim002"]

# a device with a hostile name: a plain MQTT client with a will, killed to go offline
HOSTILE_DEVICE = r"""
import json, sys, time
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
port, dev = int(sys.argv[1]), sys.argv[2]
c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="hostile", protocol=mqtt.MQTTv5)
c.will_set(f"tandoor/{dev}/status", json.dumps({"online": False, "reason": "connection lost"}), qos=1, retain=True)
c.connect("127.0.0.1", port, 60)
c.loop_start()
c.publish(f"tandoor/{dev}/status", json.dumps({"online": True, "state": "running",
          "model": {"name": dev, "version": "<i>1</i>", "sha256": "d" * 64}}), qos=1, retain=True).wait_for_publish(10)
print("up", flush=True)
time.sleep(600)
"""


# the fleet table as the page has it now, read in one go
ROWS_JS = """
const rows = [...document.querySelectorAll('#devices tbody tr.row')];
return {rows: rows.map(r => r.dataset.device),
        links: Object.fromEntries(rows.map(r => [r.dataset.device, r.querySelector('a').textContent])),
        cats: Object.fromEntries(rows.map(r => [r.dataset.device, r.querySelector('.cat').textContent])),
        imgs: document.querySelectorAll('#devices img').length, xss: window.__xss === undefined ? null : window.__xss,
        total: document.getElementById('n-total').textContent};
"""


@pytest.fixture(scope="module")
def B(bundles_dir, tmp_path_factory):  # noqa: N802 (make_bundles' bundles, by the name the tests index)
    return make_bundles(bundles_dir, tmp_path_factory.mktemp("consolebundles"))


def _browser(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
              "--window-size=1400,1000"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def _load_sim():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fleet_sim", ROOT / "scripts" / "fleet-sim.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_console_in_a_real_browser(tmp_path, B):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    shots = Path(os.environ.get("TANDOOR_SCREENSHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    bundles = tmp_path / "bundles"
    bundles.mkdir()
    shutil.copy(B["v2"], bundles / "dynamic_batch-v2.hmod")
    t_start = time.monotonic()
    with Broker(tmp_path / "broker") as b, Recorder(b.port, "tandoor/+/status") as rec:
        console = ConsoleProcess(tmp_path / "console", b.port, users={"op": ("operator", f"token:{TOKEN}")},
                                 bundles=bundles).start()
        sd = seed_slots(tmp_path / "cam1-slots", B["v1"], B["pub"])
        agent = AgentProcess(["--config", str(agent_config(tmp_path, "cam1", b.port, sd, B["pub"],
                                                           snapshot={"period_s": 1.0}))], tmp_path / "cam1.log")
        hostile = subprocess.Popen([sys.executable, "-c", HOSTILE_DEVICE, str(b.port), HOSTILE], stdout=subprocess.PIPE)
        (tmp_path / "sim").mkdir()
        sim = _load_sim().SimFleet(len(SIMS), b.port, tmp_path / "sim", B["pub"], B["v1"], processes=1, gate_s=0.1)
        driver = None
        try:
            sim.__enter__()
            assert hostile.stdout.readline().strip() == b"up"
            rec.wait_for(lambda m: m.topic == "tandoor/cam1/status" and m.json().get("state") == "running",
                         START_TIMEOUT, "cam1 running")
            t_browser = time.monotonic()
            driver = _browser(tmp_path / "chromium-profile")
            # the live part of a page is replaced at every change: waits ignore a replaced element,
            # and what is checked together is read in one script
            wait = WebDriverWait(driver, 30, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,))
            driver.get(console.url + "/")
            driver.find_element(By.NAME, "name").send_keys("op")
            driver.find_element(By.NAME, "secret").send_keys(TOKEN)
            driver.find_element(By.CSS_SELECTOR, "form.action button").click()

            # --- the fleet: rows and counts, live
            wait.until(lambda d: d.find_element(By.ID, "n-online").text == "5")
            page = driver.execute_script(ROWS_JS)
            assert sorted(page["rows"]) == sorted(["cam1", HOSTILE, *SIMS]) and page["total"] == "5", page
            # the hostile name: text in a link, no element made of it, its handler never ran
            assert page["links"][HOSTILE] == HOSTILE and page["imgs"] == 0 and page["xss"] is None, page
            driver.save_screenshot(str(shots / "console-fleet.png"))

            # --- a device going offline: the will, then the page without a reload
            driver.execute_script("window.__same_page = 1")
            t_kill = time.monotonic()
            hostile.send_signal(signal.SIGKILL)
            wait.until(lambda d: d.find_element(By.ID, "n-offline").text == "1")
            offline_s = time.monotonic() - t_kill
            assert driver.execute_script(ROWS_JS)["cats"][HOSTILE] == "offline"
            assert driver.execute_script("return window.__same_page") == 1, "the page was reloaded"
            assert offline_s < 5, f"offline shown after {offline_s:.1f} s"

            # --- the real agent's page: charts with points, a snapshot that decodes
            driver.get(f"{console.url}/device/cam1")
            wait.until(lambda d: int(d.execute_script(
                "const c = document.querySelector('.chart[data-title=\"FPS\"] .uplot');"
                "return c ? c.dataset.points || 0 : 0")) >= 3)
            wait.until(lambda d: d.execute_script(
                "const i = document.getElementById('snapshot'); return i && i.complete && i.naturalWidth"))
            w, h = driver.execute_script("const i = document.getElementById('snapshot'); return [i.naturalWidth, i.naturalHeight]")
            cookie = "; ".join(f"{c['name']}={c['value']}" for c in driver.get_cookies())
            jpeg = urllib.request.urlopen(urllib.request.Request(f"{console.url}/device/cam1/snapshot.jpg",
                                                                 headers={"Cookie": cookie}), timeout=10).read()
            from PIL import Image

            img = Image.open(io.BytesIO(jpeg))
            img.load()
            assert img.format == "JPEG" and img.size == (w, h) == (64, 48), (img.size, w, h)
            driver.save_screenshot(str(shots / "console-device.png"))

            # --- a deploy from the page, to every device still online: committed on each
            driver.get(f"{console.url}/deployments")
            Select(driver.find_element(By.NAME, "bundle")).select_by_visible_text("dynamic_batch-v2.hmod")
            driver.find_element(By.NAME, "devices").send_keys(",".join(["cam1", *SIMS]))
            driver.find_element(By.NAME, "canary").clear()
            driver.find_element(By.NAME, "canary").send_keys("25")
            driver.find_element(By.ID, "deploy").click()
            wait.until(lambda d: "/deployments/" in d.current_url)
            WebDriverWait(driver, 180, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,)).until(lambda d: sorted(
                e.text for e in d.find_elements(By.CSS_SELECTOR, "#job-devices td.state")) == ["committed"] * 4)
            wait.until(lambda d: d.find_element(By.ID, "job-state").text == "done")
            assert "1 committed" in driver.find_element(By.CSS_SELECTOR, "table.waves").text  # the canary wave
            driver.save_screenshot(str(shots / "console-deployment.png"))
            # a deploy from the CLI with --db: recorded in the same database, listed on the page
            r = subprocess.run([str(BIN / "tandoor"), "fleet", "deploy", str(B["v3"]), "--devices", ",".join(SIMS),
                                "--broker", f"mqtt://127.0.0.1:{b.port}", "--db", console.db, "--timeout", "120",
                                "--json"], capture_output=True, text=True, timeout=240)
            assert r.returncode == 0, r.stderr[-2000:]
            cli_job = json.loads(r.stdout)["job_id"]
            driver.get(f"{console.url}/deployments")
            wait.until(lambda d: f"{cli_job} " in d.find_element(By.CSS_SELECTOR, "table.jobs").text
                       and "3 committed" in d.find_element(By.CSS_SELECTOR, "table.jobs").text)  # the acks, live
            jobs_text = driver.find_element(By.CSS_SELECTOR, "table.jobs").text
            assert f"{cli_job} " in jobs_text and "the CLI" in jobs_text and "3 committed" in jobs_text, jobs_text
            # a rollback from the device page (its form post once queued ~50 s behind the event streams
            # of pages left earlier, each holding one of the browser's 6 connections to the host)
            driver.get(f"{console.url}/device/cam1")
            driver.find_element(By.CSS_SELECTOR, "form[action='/actions/rollback'] button").click()
            wait.until(lambda d: "rollback from the console (op): ok" in d.find_element(By.CSS_SELECTOR, "table.events").text)
            wait.until(lambda d: "dynamic_batch v1 " in d.find_element(By.CSS_SELECTOR, "table.kv").text)
            browser_s = time.monotonic() - t_browser
            print(f"\nbrowser checks {browser_s:.1f} s (offline shown {offline_s:.2f} s after the kill), "
                  f"whole test {time.monotonic() - t_start:.1f} s; screenshots in {shots}")
            st = json.loads(urllib.request.urlopen(urllib.request.Request(
                f"{console.url}/device/cam1/series.json", headers={"Cookie": cookie}), timeout=10).read())
            assert len(st["series"]["t"]) >= 3
        finally:
            if driver is not None:
                driver.quit()
            hostile.kill()
            sim.__exit__(None, None, None)
            agent.stop()
            rc = console.stop()
        assert rc == 0 and "Traceback" not in console.output(), console.output()[-3000:]
