"""What the window says of a run beyond its curves: the pauses that sample answers cost, where its TensorBoard files
are, the benchmarks picked in the Evaluate tab, base beside fine-tuned, and a grpo run's rewards there."""

from __future__ import annotations


from gui_states import evaluated, grpo_evaluated, training
from PySide6.QtWidgets import QApplication

from studio.core.run.evaluation import progress_of
from test_gui import open_window


def test_the_throughput_chart_marks_the_pauses_for_sample_answers_and_the_tensorboard_command_copies(qtbot, app_dirs,
                                                                                                      tmp_path):
    window = open_window(qtbot)
    training(window, qtbot, tmp_path)  # 120 steps, the sample prompts answered at 40, 80 and 120
    window.charts.redraw()
    pauses = [key for key in window.charts.throughput.lines if key.startswith("pause.")]
    assert sorted(pauses) == ["pause.120", "pause.40", "pause.80"]
    assert "paused 1.8 s to answer the sample prompts" in window.charts.throughput.title.text()
    hint = window.tensorboard_hint
    folder = window.controller.run_dir.tensorboard_dir
    assert hint.isVisible() and f'tensorboard --logdir "{folder}"' in hint.text()
    hint.linkActivated.emit("copy")
    assert QApplication.clipboard().text() == f'tensorboard --logdir "{folder}"' and "copied" in hint.text()


def test_benchmarks_typed_in_the_evaluate_tab_run_and_show_base_beside_fine_tuned(qtbot, app_dirs, tmp_path):
    window = open_window(qtbot)
    evaluated(window, qtbot, tmp_path)
    panel = window.evaluate_panel
    table = panel.benchmark_table
    shown = [tuple(table.item(r, c).text() for c in range(4)) for r in range(table.rowCount())]
    assert shown == [("arc_easy", "acc", "0.25", "0.31"), ("arc_easy", "acc_norm", "0.27", "0.3")]
    assert table.isVisible() and panel.table.rowCount() == 5  # the held-out comparison stays beside it
    assert "Benchmarks of checkpoint step-000020" in panel.status.text()
    panel.tasks.setText(" , ")
    assert not panel.benchmarks_button.isEnabled()  # no task named
    panel.set_run(window.controller.run_dir.path)  # chosen again (History): both results read back from the run
    assert panel.benchmark_table.rowCount() == 2 and panel.result is not None


def test_progress_lines_count_the_benchmarks_as_one_phase_and_the_models_as_two():
    assert progress_of("benchmarks: 1/4 [#####---------------] about 30 s left") == 0.25
    assert progress_of("tuned model: 10/10 [####################]") == 0.5
    assert progress_of("base model: 5/10 [##########----------]") == 0.75
    assert progress_of("Loading checkpoint shards: 50%") is None


def test_a_resumed_run_keeps_only_the_sample_pauses_of_the_steps_it_kept():
    from studio.gui.state.series import RunSeries

    run = RunSeries.from_events([{"type": "run_started", "start_step": 0},
                                 *({"type": "samples", "step": s, "seconds": 2.0, "samples": []} for s in (0, 10, 20)),
                                 {"type": "run_started", "start_step": 10}])
    assert list(run.sample_pauses.x) == [0, 10]


def test_a_preference_setup_shows_its_settings_its_pairs_side_by_side_and_refuses_pairs_for_sft(qtbot, app_dirs,
                                                                                                tmp_path):
    from gui_states import preference_setup

    window = open_window(qtbot)
    preference_setup(window, qtbot, tmp_path)
    techniques = window.techniques_panel
    assert techniques.beta.isVisibleTo(techniques) and techniques.reference.isVisibleTo(techniques)
    assert not techniques.simpo_gamma.isVisibleTo(techniques)  # SimPO's alone
    assert not techniques.label_smoothing.isEnabled()  # the sigmoid loss does not smooth
    html = window.data_panel.examples.toHtml()
    assert "chosen ✓" in html and "rejected ✗" in html and " kind of " in window.data_panel.examples.toPlainText()
    assert "preference pairs" in window.data_panel.summary.text() or "preference" in window.data_panel.summary.text()
    window.store.update(data={"max_length": 6})
    assert "keeps its start" in window.data_panel.cut_note.text()  # a pair is cut as TRL cuts it
    window.store.update(objective="sft")
    qtbot.waitUntil(lambda: bool(window.data_panel.problems), timeout=10000)
    assert "objective sft learns from responses" in str(window.data_panel.problems[0])
    assert not window.start_action.isEnabled()


def test_a_preference_run_charts_its_reward_margin_and_accuracy_beside_the_loss(qtbot):
    from studio.gui.state.series import RunSeries
    from studio.gui.widgets.charts import ChartsPanel

    steps = [{"type": "step", "step": s, "loss": 0.69 - s / 100, "lr": 1e-4, "tokens_per_s": 900,
              "rewards/margins": s / 10, "rewards/accuracies": min(1.0, s / 10)} for s in range(1, 11)]
    run = RunSeries.from_events([{"type": "run_started", "start_step": 0}, *steps,
                                 {"type": "eval", "step": 10, "eval_loss": 0.5, "eval_rewards/margins": 0.8,
                                  "eval_rewards/accuracies": 0.9}])
    charts = ChartsPanel()
    qtbot.addWidget(charts)
    charts.show_runs([run])
    assert "Reward margin" in charts.lr.title.text() and "preference accuracy" in charts.loss.title.text()
    assert list(charts.lr.curves) == ["0.margin", "0.eval_margin"]
    assert {"0.accuracy", "0.eval_accuracy"} <= set(charts.loss.curves)
    assert list(charts.loss.curves["0.eval_accuracy"].getData()[1]) == [0.9]



def test_a_grpo_evaluation_shows_each_reward_base_beside_fine_tuned_with_the_change(qtbot, app_dirs, tmp_path):
    window = open_window(qtbot)
    grpo_evaluated(window, qtbot, tmp_path)
    panel = window.evaluate_panel
    table = [tuple(panel.table.item(r, c).text() for c in range(4)) for r in range(panel.table.rowCount())]
    assert table == [("reward (weighted total)", "0.5", "1.25", "+0.75"),
                     ("reward matches_format", "0", "0.75", "+0.75"), ("reward length_within", "1", "1", "+0"),
                     ("prompts given every reward", "0.0%", "75.0%", "+75.0 pts")]
    ticks = [label for _, label in panel.chart.getAxis("bottom")._tickLevels[0]]
    assert ticks == ["every\nreward", "matches_\nformat", "length_\nwithin"] and panel.chart.isVisible()  # no overlap
    first = panel.rows.topLevelItem(0)
    assert panel.rows.topLevelItemCount() == 12 and first.text(2) == "fruit"
    assert first.text(5) == "reward 0.5"
    assert "fine-tuned reward 0.5: matches_format 0, length_within 1" in first.toolTip(5)  # each function's
    assert "12 held-out prompts, one greedy completion each (at most 12 tokens); checkpoint step-000020" in \
        panel.status.text()
