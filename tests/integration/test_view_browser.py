"""`verlj view` in a real headless browser (Debian's chromium and chromium-driver, driven by Selenium;
the README's test command installs them, nothing is downloaded at run time): what a person sees of
a 3-step GRPO run, a multi-turn run (builtin:guess) and a what-if of the first, compared with what
the journal's readers answer. One server and one browser for the module; the screenshots are kept
under each test's tmp dir (docs/img/viewer-*.png were taken so)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from verlj.engine.loop.run import train as run_train
from verlj.engine.post_mortem import inspection, metrics
from verlj.engine.post_mortem.counterfactual import whatif
from verlj.engine.post_mortem.view import Server
from verlj_testing import TINY, fingerprints, train

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
RUN = [*TINY, "trainer.total_steps=3", "trainer.save_interval=2"]
EPISODES = [*TINY, "rollout.env=builtin:guess", "rollout.max_turns=3", "model.tiny.vocab=ascii", "trainer.total_steps=2"]
TOOLS = [*TINY, "model.tiny.vocab=ascii", "rollout.agent=agents_for_tests:ticketing", "rollout.max_turns=2", "trainer.total_steps=2",
         "rollout.tools=[tools_for_tests:post_message]", "rollout.max_fault_rate=1"]
WAIT = 20  # seconds: what a page may take to draw itself on a loaded 2-core machine


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("view")
    run_train(root / "grpo", None, RUN)
    run_train(root / "episodes", None, EPISODES)
    assert whatif(root / "grpo", 1, None, root / "lr", ["model.actor.optim.lr=0.003"]) == (2, 3)
    # rollout.tools through a kill after a keyless post was applied and before its result was durable: its episode unresolved
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "VERLJ_TEST_TOOL": "post_message", "VERLJ_TEST_EFFECTS": str(root / "posts")}
    assert train(root / "tools", *TOOLS, VERLJ_FAILPOINT="tools.after_run:19", **env).returncode == -9
    assert train(root / "tools", *TOOLS, resume=True, **env).returncode == 0
    return root


@pytest.fixture(scope="module")
def browser(runs):
    for path in (CHROMIUM, CHROMEDRIVER):
        assert os.access(path, os.X_OK), f"{path} is missing: apt-get install -y chromium chromium-driver (the README's test command does)"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    server = Server([runs / "grpo", runs / "lr", runs / "episodes", runs / "tools"], port=0)
    server.start()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1300,1000"):
        options.add_argument(arg)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SE_OFFLINE", "true")  # selenium-manager: never fetch a browser or a driver
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.base = f"http://127.0.0.1:{server.port}"
    yield driver
    driver.quit()
    server.stop()


def open_page(driver, path: str, ready: str):
    """Go to `path`; wait for the CSS selector `ready` to be on the page; return that element."""
    driver.get(driver.base + path)
    return wait_for(driver, ready)


def wait_for(driver, css: str):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT).until(lambda d: d.find_elements(By.CSS_SELECTOR, css))[0]


def find(driver, css: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def js(v: float) -> str:
    """A number as the page writes it (app.js fmt: an integer whole, else toPrecision(5))."""
    return str(int(v)) if float(v).is_integer() else f"{v:#.5g}"


def shot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"viewer-{name}.png"
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    return path


def test_the_run_shows_its_last_step_and_charts_of_its_metrics(browser, runs, tmp_path):
    last = open_page(browser, "/run/grpo/", "#charts .chart svg polyline")
    assert find(browser, "#last-step")[0].text == "3"
    reward = find(browser, '.chart[data-metric="critic/score/mean"]')
    assert reward and len(reward[0].find_elements("css selector", "circle")) == 3 and last.is_displayed()
    want = [r["critic/score/mean"] for r in metrics.metric_rows(runs / "grpo", ["critic/score/mean"], None)[1]]
    said = [c.find_element("css selector", "title").get_attribute("textContent") for c in reward[0].find_elements("css selector", "circle")]
    assert said == [f"grpo step {s}: {js(v)}" for s, v in zip((1, 2, 3), want)]
    # choose another metric: its chart is drawn
    assert not find(browser, '.chart[data-metric="actor/lr"]')
    find(browser, "details.card summary")[0].click()
    find(browser, 'input[value="actor/lr"]')[0].click()
    assert len(find(browser, '.chart[data-metric="actor/lr"] circle')) == 3
    assert [a.text for a in find(browser, "#steps a")] == ["step 3", "step 2", "step 1"]
    shot(browser, tmp_path, "run")


def test_a_step_shows_its_samples_by_group_with_log_probs_seeds_and_fingerprint(browser, runs, tmp_path):
    open_page(browser, "/run/grpo/step/2", "#samples .group")
    d = inspection.step_detail(runs / "grpo", 2)
    assert find(browser, "#fingerprint")[0].text == d.fingerprint == fingerprints(runs / "grpo")[2]
    assert find(browser, "#seeds")[0].text == " · ".join(f"{k} {v}" for k, v in d.seeds.items())  # every digit: no float rounding
    assert find(browser, "#previous") and find(browser, "#next")  # steps 1 and 3
    groups = find(browser, "#samples .group")
    assert len(groups) == 4 and all(len(g.find_elements("css selector", ".sample[data-sample]")) == 4 for g in groups)
    first = d.samples[0]
    assert groups[0].find_element("css selector", ".prompt").get_attribute("textContent") == first.prompt
    sample = find(browser, f'.sample[data-sample="{first.id}"]')[0]
    tokens = sample.find_elements("css selector", ".tok")
    assert "".join(t.get_attribute("textContent") for t in tokens) == first.response
    assert tokens and all(t.get_attribute("title").startswith("log-prob -") for t in tokens)
    assert f"score {js(first.score)}" in sample.text
    shot(browser, tmp_path, "step")


def test_an_episode_reads_turn_by_turn(browser, runs, tmp_path):
    open_page(browser, "/run/episodes/step/2", "#samples .group")
    d = inspection.step_detail(runs / "episodes", 2)
    s = max(d.samples, key=lambda x: len(x.episode.turns))
    assert len(s.episode.turns) > 1
    assert find(browser, "#previous") and not find(browser, "#next")  # the run's last step
    shown = find(browser, f'.sample[data-sample="{s.id}"] .turn')
    assert len(shown) == len(s.episode.turns)
    for n, (turn, el) in enumerate(zip(s.episode.turns, shown)):
        said = el.get_attribute("textContent")
        assert said.startswith(f"turn {n + 1}{json.dumps(turn.action, ensure_ascii=False)} ⇒ {json.dumps(turn.observation, ensure_ascii=False)}"), said
    # the observation's tokens are shown apart (masked out of the loss), the actions' with their log-probs
    assert find(browser, f'.sample[data-sample="{s.id}"] .tok.obs')
    shot(browser, tmp_path, "episode")


def test_an_agents_tool_calls_show_their_keys_and_an_unresolved_episode_says_so(browser, runs, tmp_path):
    d = inspection.step_detail(runs / "tools", 2)
    unresolved = [s for s in d.samples if s.episode.env_end == 6]
    done = next(s for s in d.samples if s.episode.env_end != 6 and s.episode.tools)
    assert unresolved
    open_page(browser, "/run/tools/step/2", "#samples .group")
    for s in unresolved:  # its reason, naming the call and its key, and the call itself: sent, its outcome unknown
        said = find(browser, f'.sample[data-sample="{s.id}"] .badge.bad')[-1].get_attribute("textContent")
        assert said == f"ended unresolved, never trained on: {s.episode.env_reason}" and "post_message, key verlj-" in said
        (line,) = find(browser, f'.sample[data-sample="{s.id}"] .turn.tool')
        t = s.episode.tools[0]
        assert line.get_attribute("textContent") == f"tool 1{t.name}({t.arguments}) → (sent; its outcome unknown)external, sent, attempt {t.attempt}{t.key}"
    (line,) = find(browser, f'.sample[data-sample="{done.id}"] .turn.tool')
    t = done.episode.tools[0]
    assert line.get_attribute("textContent") == f"tool 1{t.name}({t.arguments}) → {t.result}external, done, attempt {t.attempt}{t.key}"
    shot(browser, tmp_path, "tools")


def test_two_runs_part_at_the_first_divergent_step(browser, runs, tmp_path):
    said = open_page(browser, "/compare/grpo/lr", "#divergence").text
    d = inspection.first_difference(runs / "grpo", runs / "lr")
    assert d.step == 2 and said.startswith("first difference at step 2:")
    if d.detail.stages is not None:
        assert find(browser, "#stage")[0].text.startswith(f"first differing stage: {d.detail.stages.stage}")
    reward = find(browser, '.chart[data-metric="critic/score/mean"]')[0]
    assert len(reward.find_elements("css selector", "polyline")) == 2 and reward.find_elements("css selector", "line.mark")
    open_page(browser, "/compare/grpo/lr", '#side [data-run="lr"] .group')
    left, right = find(browser, '#side [data-run="grpo"]')[0], find(browser, '#side [data-run="lr"]')[0]
    assert "grpo step 2" in left.text and "lr step 2" in right.text
    # a what-if trains on its source's samples: the same prompts side by side
    assert [e.text for e in left.find_elements("css selector", ".prompt")] == [e.text for e in right.find_elements("css selector", ".prompt")]
    shot(browser, tmp_path, "compare")


def test_search_finds_the_steps_find_finds(browser, runs):
    where = "critic/score/mean >= 0"
    open_page(browser, "/run/grpo/search?where=critic%2Fscore%2Fmean+%3E%3D+0", "#step-matches")
    want = [m.step for m in metrics.find_steps(runs / "grpo", where)]
    assert [a.text for a in find(browser, "#step-matches a")] == [f"step {s}" for s in want] and want


def test_a_point_of_a_chart_opens_its_step(browser):
    open_page(browser, "/run/grpo/", '.chart[data-metric="critic/score/mean"] circle')
    find(browser, '.chart[data-metric="critic/score/mean"] circle')[1].click()
    assert wait_for(browser, "#step-number").text == "2" and browser.current_url.endswith("/run/grpo/step/2")


def test_a_step_the_run_lacks_is_a_404_page(browser):
    assert open_page(browser, "/run/grpo/step/9", "#error").text == "step 9 is not in run grpo: it has steps 1–3"


def test_new_steps_appear_while_the_run_trains_without_a_reload(browser, runs):
    """Last in the module: it trains the run on to step 4."""
    open_page(browser, "/run/grpo/", "#charts .chart svg polyline")
    browser.execute_script("window.notReloaded = true")
    out = train(runs / "grpo", resume=True)  # TINY: trainer.total_steps=4
    assert out.returncode == 0, out.stderr[-3000:]
    deadline = time.monotonic() + WAIT
    while find(browser, "#last-step")[0].text != "4" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert find(browser, "#last-step")[0].text == "4" and browser.execute_script("return window.notReloaded") is True
    assert len(find(browser, '.chart[data-metric="critic/score/mean"] circle')) == 4

