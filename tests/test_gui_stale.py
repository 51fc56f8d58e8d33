"""Every asynchronous result belongs to what it was asked for: the setup (or the run, prompt, export choice)
is changed while each job runs, and the result that comes back must not be shown as the new one's."""
# ruff: noqa: F811 (test_gui's fixtures, imported, are the tests' parameters)

import json
import sys

from studio.core.memory.parts import OVERHEAD_PARTS
from studio.core.presets import DEMO_TRAIN
from test_gui import wait_for_preview, window, write_run  # noqa: F401 (fixtures)

SLOW = "import time, json, sys; time.sleep({seconds}); "


def stand_in(code: str, seconds: float = 1.5) -> list[str]:
    return [sys.executable, "-c", SLOW.format(seconds=seconds) + code]


def test_a_simulation_of_an_older_setup_is_dropped(window, qtbot):
    panel = window.estimate_panel
    result = json.dumps({"simulated": {"peak_bytes": 250_000_000, "peak_phase": "backward"}})
    panel.simulate_command = lambda path: stand_in(f"print({result!r})", seconds=5)
    panel.simulate_button.click()
    assert panel.simulating
    window.store.update(training={"micro_batch_size": 4})  # e.g. Fit to my GPU while it runs
    qtbot.waitUntil(lambda: not panel.simulating, timeout=20000)
    assert "Simulated peak" not in panel.result.text() and "dropped" in panel.result.text()
    assert panel.simulate_button.text() == "Simulate" and panel.simulate_button.isEnabled()


def test_a_simulation_is_compared_with_the_estimate_it_was_asked_for(window, qtbot):
    panel = window.estimate_panel
    tensors = panel.estimate.peak_bytes - sum(panel.estimate.parts.get(k, 0) for k in OVERHEAD_PARTS)
    result = json.dumps({"simulated": {"peak_bytes": tensors, "peak_phase": "backward"}})
    panel.simulate_command = lambda path: stand_in(f"print({result!r})")
    panel.simulate_button.click()
    panel.picker.select_custom(3)  # another GPU: the config, and so the simulated step, is the same
    qtbot.waitUntil(lambda: not panel.simulating, timeout=20000)
    assert "Simulated peak" in panel.result.text() and "(+0 %)" in panel.result.text().replace("+0%", "+0 %")


def test_a_preview_of_files_no_longer_chosen_never_arrives(window, qtbot, tmp_path):
    data = window.data_panel
    window.setup_tabs.setCurrentWidget(data)
    wait_for_preview(qtbot, window)
    many = tmp_path / "many.jsonl"
    row = DEMO_TRAIN.read_text().splitlines()[0]
    many.write_text((row + "\n") * 20000)
    data.set_files([str(many)])
    data.set_files([])  # removed while it is read
    wait_for_preview(qtbot, window)
    qtbot.wait(1500)  # the older read finishes meanwhile
    assert data.preview is None and data.banner.isVisible() and "no training data" in data.banner.text.text()
    data.set_files([str(many)])
    data.set_files([str(DEMO_TRAIN)])  # another file while the first is read
    wait_for_preview(qtbot, window)
    qtbot.wait(1500)
    assert data.preview.rows == len(DEMO_TRAIN.read_text().splitlines())


def test_answers_for_another_run_or_prompt_are_dropped(window, qtbot, app_dirs):
    first, second = (write_run(app_dirs / "runs", name, [2.0, 1.0]) for name in ("first", "second"))
    answers = json.dumps({"base": "drink .", "tuned": "a kind of fruit", "checkpoint": "step-000002"})
    panel = window.try_panel
    window.run_tabs.setCurrentWidget(panel)
    panel.command = lambda run_dir, prompt, tokens, image: stand_in(f"print({answers!r})")
    panel.set_run(first)
    panel.prompt.setPlainText("What kind of thing is a plum?")
    panel.generate_button.click()
    panel.prompt.setPlainText("What kind of thing is a pear?")
    qtbot.waitUntil(panel.generate_button.isEnabled, timeout=20000)
    assert panel.answers["tuned"].toPlainText() == "" and "dropped" in panel.status.text()
    panel.generate_button.click()
    panel.set_run(second)  # a run ended meanwhile, or another was chosen in History
    qtbot.waitUntil(panel.generate_button.isEnabled, timeout=20000)
    assert panel.answers["tuned"].toPlainText() == "" and "dropped" in panel.status.text()
    assert "step-000002" not in panel.titles["tuned"].text()


def test_an_export_of_another_run_is_not_shown_as_this_ones(window, qtbot, app_dirs):
    first, second = (write_run(app_dirs / "runs", name, [2.0, 1.0]) for name in ("first", "second"))
    record = json.dumps({"form": "adapter", "verification": {"passed": True, "samples": 4, "max_abs_diff": 0.0,
                                                               "top1_agreement": 1.0}})
    panel = window.export_panel
    window.run_tabs.setCurrentWidget(panel)
    panel.command = lambda run_dir, kind, out, *_: stand_in(
        f"import pathlib; out = pathlib.Path({str(out)!r}); out.mkdir(parents=True, exist_ok=True); "
        f"(out / 'studio_export.json').write_text({record!r})")
    panel.set_run(first)
    panel.start_export()
    panel.set_run(second)
    qtbot.waitUntil(lambda: not panel._process.running, timeout=20000)
    assert "Verified" not in panel.status.text() and "not shown" in panel.status.text()
    assert panel.result_info is None
    panel.start_export()  # nothing changes while this one runs: its verification is shown
    qtbot.waitUntil(lambda: not panel._process.running, timeout=20000)
    assert "Verified" in panel.status.text() and "second" in panel.status.text()
