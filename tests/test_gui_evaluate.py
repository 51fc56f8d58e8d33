"""What the window says of a run beyond its curves: the pauses that sample answers cost, where its TensorBoard files
are, and the benchmarks picked in the Evaluate tab, base beside fine-tuned."""

from __future__ import annotations

from gui_states import evaluated, training
from PySide6.QtWidgets import QApplication

from studio.core.run.evaluation import progress_of
from test_gui import app_dirs, open_window  # noqa: F401 (app_dirs: a fixture)


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
