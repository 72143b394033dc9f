"""The dashboard's screenshots for docs/screenshots/: runs list, run page (light and dark), samples view, compare,
launch form, a sweep's page, the new-sweep form and the evaluations page, each at 1440x900 and 390x844, from `molt
serve` on a temporary home with two small finished runs, a finished 2x2 sweep and an evaluation of the first run.

    python bench/screenshots.py [--out docs/screenshots]

Needs Debian's Chromium (/usr/bin/chromium) and Playwright. Each PNG is the viewport (not the whole page), reduced
to 256 colours so that it stays small (~100-200 KB).
"""
import argparse
import tempfile
import time
from pathlib import Path

from app_common import ROOT, Child

import httpx  # noqa: E402
from PIL import Image  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

RUNS = {  # a text run with evals, and a shorter one beside it in the list
    "max-digit-demo": {"env": "max_digit", "warm_start": {"steps": 20}, "checkpoint": {"every": 0},  # it learns
                       "loop": {"steps": 30, "groups_per_step": 4, "group_size": 4, "eval_every": 5,
                                "eval_episodes": 8}},
    "guess-number-demo": {"env": "guess_number", "warm_start": {"steps": 5}, "checkpoint": {"every": 0},
                          "loop": {"steps": 6, "groups_per_step": 2, "group_size": 3, "eval_every": 0}},
}
SWEEP = {"name": "lr-demo", "seeds": 1, "params": {"algo.lr": {"values": [3e-4, 3e-3]},
                                                   "loop.group_size": {"values": [3, 4]}},
         "config": {"env": "max_digit", "warm_start": {"steps": 5}, "checkpoint": {"every": 0},
                    "loop": {"steps": 6, "groups_per_step": 2, "eval_every": 3, "eval_episodes": 4}}}
SIZES = {"1440": {"width": 1440, "height": 900}, "390": {"width": 390, "height": 844}}
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def shoot(page, path: Path):
    page.screenshot(path=str(path))
    Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)
    print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {path.stat().st_size // 1024} KB")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as home:
        child = Child("serve", Path(home))
        try:
            client = httpx.Client(base_url=child.base, headers={"Authorization": f"Bearer {child.token}"}, timeout=60)
            ids = []
            for name, config in RUNS.items():
                response = client.post("/api/v1/runs", json={"config": config, "name": name})
                response.raise_for_status()
                ids.append(response.json()["id"])
            sweep = client.post("/api/v1/sweeps", json=SWEEP)  # its runs queue behind those
            sweep.raise_for_status()
            for run_id in ids:  # /wait answers when the run ends, or after 30 s
                run = {"status": "queued"}
                while run["status"] in ("queued", "running", "restarting", "stopping"):
                    run = client.get(f"/api/v1/runs/{run_id}/wait", params={"timeout": 30}).json()
                print(f"run {run_id}: {run['status']} at step {run['step']}")
            run_id = ids[0]
            evaluation = client.post("/api/v1/evals", json={"run_id": run_id, "checkpoint": "final", "episodes": 8})
            evaluation.raise_for_status()
            while (sweep := client.get(f"/api/v1/sweeps/{sweep.json()['id']}")).json()["status"] == "running":
                time.sleep(2)  # no /wait for sweeps: its runs take a minute or two
            print(f"sweep {sweep.json()['id']}: {sweep.json()['status']}, best {sweep.json()['best']}")
            done = client.get(f"/api/v1/evals/{evaluation.json()['id']}/wait", params={"timeout": 600}).json()
            print(f"evaluation {done['id']}: {done['status']}")
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
                for size, viewport in SIZES.items():
                    for theme in ("light", "dark"):
                        context = browser.new_context(viewport=viewport, color_scheme=theme)
                        page = context.new_page()
                        page.goto(f"{child.base}/?token={child.token}")
                        page.wait_for_selector("table")
                        if theme == "light":
                            shoot(page, args.out / f"runs-list-{size}.png")
                        page.goto(f"{child.base}/runs/{run_id}")
                        page.wait_for_selector("#chart-reward_mean:not([hidden]) canvas")
                        page.wait_for_selector("#log pre")
                        shoot(page, args.out / f"run-page-{theme}-{size}.png")
                        if theme == "light":  # (page, what shows it is drawn, file name)
                            views = [(f"/runs/{run_id}/samples?color=logprob", "#samples[data-loaded]", "samples"),
                                     (f"/compare?ids={','.join(map(str, ids))}"
                                      "&metrics=reward_mean,pass_rate,eval_reward,policy_loss",
                                      "#chart-reward_mean:not([hidden]) canvas", "compare"),
                                     ("/runs/new", "#launch-form", "launch-form"),
                                     (f"/sweeps/{sweep.json()['id']}", "#sweep-runs tbody tr[id]", "sweep"),
                                     (f"/sweeps/new?run_id={run_id}", "#new-sweep", "new-sweep-form"),
                                     ("/evals", f"#eval-{done['id']}", "evaluations")]
                            for path, drawn, name in views:
                                page.goto(child.base + path)
                                page.wait_for_selector(drawn)
                                shoot(page, args.out / f"{name}-{size}.png")
                        context.close()
                browser.close()
        finally:
            child.stop()


if __name__ == "__main__":
    main()
