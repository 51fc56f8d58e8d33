"""GRPO from the window (issue 28): choosing it shows its settings and rewards; rewards are picked, weighed and
set row by row, each row saying what is wrong with it; a reward file runs only once trusted; a run charts its reward,
the spread within groups, completion length and the policy's moves, and the Samples tab shows the completions with
the rewards they earned."""
# ruff: noqa: F811 (test_gui's fixtures, imported, are the tests' parameters)

from PySide6.QtWidgets import QApplication

from studio.core.config import RewardConfig
from studio.core.presets import DEMO_FORMAT
from studio.gui.state.job_state import State
from test_gui import open_window, wait_for_preview
from test_gui_runs import WORKER_TIMEOUT_MS


def _objective_index(window, value: str) -> int:
    return next(i for i, option in enumerate(window.techniques_panel.objective.options) if option.value == value)


def test_choosing_grpo_shows_its_settings_and_leaves_room_for_a_prompt(qtbot, app_dirs):
    window = open_window(qtbot)
    panel = window.techniques_panel
    assert not panel.grpo_group.isVisibleTo(panel)
    combo = panel.objective.combo
    assert combo.model().item(_objective_index(window, "grpo")).isEnabled()  # the window trains GRPO now
    combo.setCurrentIndex(_objective_index(window, "grpo"))
    config = window.store.config
    assert config.objective == "grpo" and panel.grpo_group.isVisibleTo(panel)
    # the default completion length (256) left no prompt room in the demo's sequence length (64)
    assert config.grpo.max_completion_length == config.data.max_length // 2 == panel.max_completion.spin.value()
    assert not [p for p in window.store.problems() if p.where.startswith("grpo")]
    # the demo's instruction rows are its prompts, their answers the references: it can start as it is
    wait_for_preview(qtbot, window)
    assert not window.data_panel.problems and window.start_action.isEnabled()
    data = window.data_panel
    assert not any(t.isEnabled() for t in (data.train_on_prompt, data.last_turn_only, data.learn_reasoning))
    assert "learns the completions the model samples" in data.last_turn_only.toolTip()


def test_rewards_are_set_row_by_row_and_each_row_says_what_is_wrong(qtbot, app_dirs, tmp_path):
    window = open_window(qtbot)
    window.new_grpo_setup()
    panel = window.techniques_panel
    editor = panel.rewards
    assert [row.pattern.text() for row in editor.rows] == [DEMO_FORMAT]
    editor.add_button.click()
    contains = editor.rows[1]
    contains.name.setCurrentIndex(next(i for i, o in enumerate(contains.names) if o.value == "contains"))
    assert contains.text.isVisibleTo(contains) and not contains.pattern.isVisibleTo(contains)
    assert "needs the text" in contains.problems.text()
    assert any("Reward 2" in line for line in _listed(window))  # named as the window shows it, not grpo.rewards[1]
    assert not window.start_action.isEnabled()

    contains.text.setText("kind of")
    contains.text.editingFinished.emit()
    contains.weight.setValue(0.5)
    assert window.store.config.grpo.rewards[1] == RewardConfig(name="contains", text="kind of", weight=0.5)
    assert not contains.problems.text() and window.start_action.isEnabled()

    editor.rows[0].remove.click()
    assert [r.name for r in window.store.config.grpo.rewards] == ["contains"] and len(editor.rows) == 1


def test_a_reward_file_runs_only_once_trusted(qtbot, app_dirs, tmp_path):
    window = open_window(qtbot)
    window.new_grpo_setup()
    reward_file = window.techniques_panel.reward_file
    path = tmp_path / "my_reward.py"
    path.write_text("def reward(completion, prompt, row):\n    return float('kind' in completion)\n")
    reward_file.path_edit.setText(str(path))
    reward_file.path_edit.editingFinished.emit()
    assert window.store.config.grpo.reward_file == str(path)
    assert "runs only when you trust it" in reward_file.reason.text() and not window.start_action.isEnabled()
    reward_file.trust.check.setChecked(True)
    assert window.store.config.grpo.trust_reward_code and not reward_file.reason.text()
    assert window.start_action.isEnabled()


def test_a_grpo_run_charts_its_rewards_and_shows_the_completions_with_their_rewards(qtbot, app_dirs):
    window = open_window(qtbot)
    window.new_grpo_setup()
    window.techniques_panel.max_steps.spin.setValue(3)
    window.start_action.trigger()
    ended = (State.FINISHED, State.FAILED, State.CRASHED)
    qtbot.waitUntil(lambda: window.controller.job.state in ended, timeout=WORKER_TIMEOUT_MS)
    assert window.controller.job.final_status == "completed", (window.status.text(), window.run_banner.text.text())

    charts = window.charts
    assert "Reward" in charts.loss.title.text() and charts.completion_length.isVisibleTo(charts)
    assert list(charts.loss.curves["0.reward_raw"].xData) == [1.0, 2.0, 3.0]
    assert list(charts.lr.curves["0.reward_std_in_group"].xData) == [1.0, 2.0, 3.0]
    assert len(charts.completion_length.curves["0.completions/mean_length"].xData) == 3
    assert "0.clip_ratio/region_mean" in charts.policy.curves
    held_out = charts.loss.curves["0.eval_reward"]
    assert list(held_out.xData) == [0.0, 3.0]  # the base's before the first step, the tuned one's at the end

    window.run_tabs.setCurrentWidget(window.samples_panel)
    QApplication.processEvents()
    shown = window.samples_panel.view.toPlainText()
    assert "step 3:" in shown and "step 1:" in shown and "reward " in shown
    assert "GRPO samples 8 completions" in window.samples_panel.note.text()


def _listed(window) -> list[str]:
    return [window.store.words(str(p)) for p in window.listed_problems()]


def test_what_a_training_run_warns_of_shows_above_its_charts_in_the_windows_words(qtbot, app_dirs):
    window = open_window(qtbot)
    job = window.controller.job
    job.state = State.RUNNING
    job.warnings = [("my_reward.py:3 raised on grpo_train.jsonl:12: ZeroDivisionError", "fix the file and resume"),
                    ("steps 1 to 10: every completion of a group got the same reward (0 on average), so GRPO learns "
                     "nothing from them", "sample more completions per prompt (grpo.group_size)")]
    window._show_run_banner()
    text = window.run_banner.text.text()
    assert window.run_banner.isVisibleTo(window) and "learns nothing" in text and "2 warnings so far" in text
    assert "“Completions per prompt”" in text and "grpo.group_size" not in text  # the label the window shows
    job.state = State.IDLE  # no worker to stop when the window closes
