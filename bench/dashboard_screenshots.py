"""Screenshots of the dashboard for the docs: idle, serving, degraded, and on a phone.

    nice .venv/bin/python bench/dashboard_screenshots.py [--out docs]

Starts what `kvasird localnet up` starts (a local chain and three daemons that split the
bundled model as the market decides, settlement on), then photographs node 0's
dashboard in headless Chromium: once the swarm routes and nothing was asked (idle);
while chat requests run, after a paid request whose receipts have arrived, with a
question asked in its web chat (serving; then at phone width); and after node 2 is stopped
(degraded: no route, the missing layers named). Everything it started is stopped, and
its temporary folder removed, before it exits.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvasird.localnet import LocalNet, demo
from kvasird.model.bundled import bundled_path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "gateway"))
from browser import ask, evaluate  # noqa: E402

WIDE, PHONE = (1280, 900), (390, 844)
"""Viewports; each screenshot is as tall as the page."""
QUESTIONS = ["What is the capital of France?", "Name a colour of the sky.",
             "What do bees make?", "How many legs has a cat?"]


def chat(url: str, model: str, question: str) -> None:
    httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 48, "temperature": 0,
        "messages": [{"role": "system", "content": demo.SYSTEM},
                     {"role": "user", "content": question}]})


def serve(url: str, model: str, n: int) -> None:
    """``n`` free chat requests one after another, the status read meanwhile (as an open
    dashboard does), so the routes they run on are seen. Few: the peers of a paying network
    serve a gateway only so many sessions without a receipt (free_local requests pay none)."""
    for question in QUESTIONS[:n]:
        worker = threading.Thread(target=chat, args=(url, model, question))
        worker.start()
        while worker.is_alive():
            httpx.get(url + "/status", timeout=10)
            time.sleep(0.3)
        worker.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent.parent / "docs")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvasird-dashboard-") as root:
        net = LocalNet(Path(root), 3, chain=True)
        try:
            demo.serve_model(net, bundled_path())
            net.up()
            url = demo.wait_served(net)
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            shoot(url, args.out / "dashboard-idle.png", WIDE)

            busy = threading.Thread(target=serve, args=(url, model, 3))
            busy.start()
            answer = demo.ask(net, url, QUESTIONS[0])
            print(f"paid request answered: {answer.text!r}", flush=True)
            demo.earnings(net)
            busy.join()
            log = evaluate(url + "/", ask(QUESTIONS[-1]), *WIDE,
                           shot=args.out / "dashboard-serving.png")
            print(f"wrote {args.out / 'dashboard-serving.png'}; the web chat: {log}", flush=True)
            shoot(url, args.out / "dashboard-phone.png", PHONE)

            net.nodes[2].stop()  # the other two cannot hold its share as well
            net.wait_until("the gateway has no route",
                           lambda: httpx.get(url + "/health").status_code == 503, 90)
            shoot(url, args.out / "dashboard-degraded.png", WIDE)
        finally:
            net.down()
    return 0


def shoot(url: str, out: Path, size: tuple[int, int]) -> None:
    evaluate(url + "/", "null", *size, shot=out)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
