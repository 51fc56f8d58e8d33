"""The scale-out panel: distributed choices, refusals with their reason, the estimate, the cluster bundle."""

import pytest

from studio.core.config import load_config
from studio.core.sizes import format_bytes
from test_gui import open_window


@pytest.fixture
def window(qtbot, app_dirs):  # noqa: F811
    window = open_window(qtbot)
    window.setup_tabs.setCurrentWidget(window.scale_panel)
    return window


def test_sharding_over_gpus_lowers_the_estimate_per_gpu(window):
    panel, estimate = window.scale_panel, window.estimate_panel
    window.store.update(method="full")
    single = estimate.estimate.peak_bytes
    panel.processes.spin.setValue(4)
    panel.sharding.combo.setCurrentIndex(3)  # zero3
    assert window.store.config.distributed.sharding == "zero3"
    assert len([d for d in estimate.estimate.devices if d.device != "host"]) == 4
    assert estimate.estimate.parts["optimizer_state"] < single
    # every rank's own bar, titled with its total, and what each process holds while the model loads
    titles = [title.text() for title, bar in estimate.bars if bar.isVisibleTo(estimate)]
    devices = estimate.estimate.devices
    assert titles == [f"rank {r} (cuda:{r}): {format_bytes(devices[r].total_bytes)}" for r in range(4)]
    rank0, others = estimate.estimate.loading
    assert (f"While the model loads: rank 0: {format_bytes(rank0.weights_bytes)} of weights, and the "
            f"{format_bytes(rank0.checkpoint_bytes)} checkpoint read into CPU RAM; ranks 1-3: "
            f"{format_bytes(others.weights_bytes)}") in estimate.phase.text()


def test_choices_validation_refuses_are_disabled_with_the_reason(window, tmp_path):
    panel = window.scale_panel
    offload = panel.offload_optimizer.combo.model()
    assert not offload.item(1).isEnabled() and "ZeRO" in offload.item(1).toolTip()  # no sharding yet
    assert not panel.nvme_path.edit.isEnabled() and "NVMe" in panel.nvme_path.edit.toolTip()
    assert not panel.deepspeed_config.browse.isEnabled()
    panel.processes.spin.setValue(2)
    assert not panel.layer_split.check.isEnabled() and "one process" in panel.layer_split.check.toolTip()
    panel.processes.spin.setValue(1)
    panel.sharding.combo.setCurrentIndex(2)  # zero2: optimizer offload and the DeepSpeed file apply
    assert offload.item(1).isEnabled() and panel.deepspeed_config.browse.isEnabled()
    assert not offload.item(2).isEnabled() and "needs a folder" in offload.item(2).toolTip()  # nvme: no folder yet
    assert panel.nvme_path.edit.isEnabled()
    panel.nvme_path.write(str(tmp_path))
    assert offload.item(2).isEnabled()


def test_layer_split_shows_where_the_layers_go(window):
    panel, estimate = window.scale_panel, window.estimate_panel
    assert not panel.max_gpu.isEnabled()
    panel.layer_split.check.click()
    assert window.store.config.distributed.layer_split and panel.max_gpu.isEnabled()
    assert estimate.estimate.placement is not None and "Layer split: " in estimate.phase.text()
    gpus = [d for d in estimate.estimate.devices if d.device != "host"]
    titles = [title.text() for title, bar in estimate.bars if bar.isVisibleTo(estimate)]
    assert len(gpus) == 1 or titles == [f"{d.device}: {format_bytes(d.total_bytes)}" for d in gpus]  # not ranks
    assert not panel.bundle_button.isEnabled()


def test_export_cluster_bundle_writes_a_loadable_config(window, tmp_path):
    panel = window.scale_panel
    panel.sharding.combo.setCurrentIndex(1)  # zero1
    bundle = panel.export_bundle("node-a, node-b", 2, 29600, tmp_path / "bundle")
    assert (bundle.folder / "hostfile").read_text() == "node-a slots=2\nnode-b slots=2\n"
    assert "--node-rank=1" in (bundle.folder / "launch-node-1.sh").read_text()
    assert load_config(bundle.folder / "config.yaml").distributed.sharding == "zero1"


def test_zero3_says_why_the_estimate_counts_the_whole_logits(window):
    window.store.update(method="full", distributed={"num_processes": 2, "sharding": "zero2"})
    assert "lean loss: logits are computed for at most" in window.estimate_panel.phase.text()
    window.store.update(distributed={"sharding": "zero3"})
    note = window.estimate_panel.phase.text()
    assert "no lean loss with zero3" in note and "zero2 or no sharding" in note


def test_a_pipeline_takes_one_process_per_stage_and_says_its_bubble(window):
    panel = window.scale_panel
    assert not panel.pipeline_schedule.isEnabled()  # only with a pipeline
    window.techniques_panel.accumulation.spin.setValue(4)  # four micro-batches a step flow through the stages
    panel.pipeline_stages.spin.setValue(2)
    distributed = window.store.config.distributed
    assert (distributed.pipeline_stages, distributed.num_processes) == (2, 2) and panel.pipeline_schedule.isEnabled()
    listed = " ".join(window.store.words(str(p)) for p in window.listed_problems())
    assert "“Sample answers every”" in listed and "“Batch layout”" in listed  # what the demo has that a pipeline cannot
    window.data_panel.sample_every.spin.setValue(0)
    window.techniques_panel.packing.combo.setCurrentIndex(2)  # padded
    assert not window.listed_problems()
    estimate = window.estimate_panel
    assert "layer split" not in estimate.phase.text()  # the table says it, under the bubble
    table = estimate.ways.text()  # against the other ways, a row each
    assert table.startswith("Pipeline of 2 stages, 4 micro-batches a step: each stage idles 20%")
    assert not estimate.ways.isHidden() and table.count("<tr>") == 4
    assert "layer split" in table and "ZeRO-3 or FSDP" in table and "Over the links a step" in table
    panel.pipeline_stages.spin.setValue(0)
    assert window.store.config.distributed.num_processes == 1  # its processes were the stages
    assert estimate.ways.isHidden()


def test_pipeline_replicas_take_a_process_per_stage_each_and_say_what_crosses_between_them(window):
    panel = window.scale_panel
    assert not panel.pipeline_replicas.isEnabled()  # only with a pipeline
    window.techniques_panel.accumulation.spin.setValue(4)
    window.data_panel.sample_every.spin.setValue(0)
    window.techniques_panel.packing.combo.setCurrentIndex(2)  # padded
    panel.pipeline_stages.spin.setValue(2)
    panel.pipeline_replicas.spin.setValue(2)
    assert window.store.config.distributed.num_processes == 4 and not window.listed_problems()
    assert panel.pipeline_replicas.explain.text().endswith("Now 4 processes: 2 pipeline replicas of 2 stages.")
    assert "its 2 replicas, each on its share of every batch, all-reduce" in window.estimate_panel.ways.text()
    titles = [title.text() for title, _ in window.estimate_panel.bars]
    assert titles[0].startswith("stage 0 (ranks 0, 2): ") and titles[1].startswith("stage 1 (ranks 1, 3): ")
    panel.pipeline_stages.spin.setValue(3)  # each replica gets the new stages
    assert (window.store.config.distributed.num_processes, panel.pipeline_replicas.spin.value()) == (6, 2)
    panel.processes.spin.setValue(5)  # not whole replicas: refused under the tabs, naming the counts that are
    listed = " ".join(window.store.words(str(p)) for p in window.listed_problems())
    assert "3 stages need a multiple of 3 processes, not 5" in listed and "3, 6, 9" in listed
    panel.pipeline_stages.spin.setValue(0)
    assert window.store.config.distributed.num_processes == 1


def test_the_interleaved_schedule_takes_chunks_per_gpu_and_shrinks_the_bubble(window):
    panel = window.scale_panel
    window.techniques_panel.accumulation.spin.setValue(4)
    window.data_panel.sample_every.spin.setValue(0)
    window.techniques_panel.packing.combo.setCurrentIndex(2)  # padded
    panel.pipeline_stages.spin.setValue(2)
    assert not panel.pipeline_chunks.isEnabled()  # GPipe: one chunk per GPU
    assert panel.pipeline_chunks.toolTip() == "Only with the interleaved schedule."
    assert panel.pipeline_schedule.combo.itemText(2) == "Interleaved 1F1B"
    panel.pipeline_schedule.combo.setCurrentIndex(2)
    distributed = window.store.config.distributed
    assert distributed.pipeline_schedule == "interleaved" and panel.pipeline_chunks.isEnabled()
    assert distributed.pipeline_chunks == panel.pipeline_chunks.spin.value() == 2 and not window.listed_problems()
    table = window.estimate_panel.ways.text()  # 1 - 2 x 4 / (2 x 4 + 2 - 1), against GPipe's 20%
    assert table.startswith("Pipeline of 2 stages, 2 chunks of blocks per stage, 4 micro-batches a step: each stage "
                            "idles 11%") and "pipeline (interleaved)" in table
    window.techniques_panel.accumulation.spin.setValue(5)  # not whole rounds: refused, naming the counts that are
    listed = " ".join(window.store.words(str(p)) for p in window.listed_problems())
    assert "5 do not make 2 rounds" in listed and "to 4 or 6" in listed
