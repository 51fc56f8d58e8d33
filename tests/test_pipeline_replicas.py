"""A pipeline in data replicas (num_processes = pipeline_stages x replicas): 2 stages x 2 replicas over gloo train
exactly as one process.

Each replica runs its share of the step's micro-batches through its stages, so the step of 2 replicas of
accumulation 2 is one process's step of accumulation 4: its losses, trained adapter, evaluation and resumed run must
equal that reference's within 1e-5. One 4-process run (4 processes on the CI's 2 cores are slow) and its resumed
copy serve every assertion.
"""

import pytest

from studio.core.memory.placement import pipeline_layout
from studio.core.run.commands import EXIT_OK
from studio.core.validation import validate
from studio.train.worker import run
from helpers import losses
from test_distributed import events_of, resume_cli, resumed_copy, train_cli
from test_pipeline import EXACT, STEPS, assert_same_adapter, config_for, eval_losses, trained_tensors


@pytest.fixture(scope="module")
def reference(small_data, tmp_path_factory):
    code, run_dir = run(config_for(small_data, accumulation=4), tmp_path_factory.mktemp("reference") / "run",
                        watch_stdin=False)
    assert code == EXIT_OK
    return losses(run_dir), trained_tensors(run_dir), eval_losses(run_dir)


@pytest.fixture(scope="module")
def replicated(small_data, tmp_path_factory):
    """The 2 x 2 run and its copy stopped after step 2, resumed."""
    folder = tmp_path_factory.mktemp("replicated")
    code, run_dir = train_cli(config_for(small_data, 2, replicas=2), folder)
    assert code == EXIT_OK, events_of(run_dir, "error")
    resumed = resumed_copy(run_dir, folder / "resumed")
    assert resume_cli(resumed) == EXIT_OK
    return run_dir, resumed


@pytest.mark.slow
def test_two_replicas_of_two_stages_train_like_one_process(replicated, reference):
    run_dir, _ = replicated
    expected_losses, expected_tensors, expected_eval = reference
    assert losses(run_dir) == pytest.approx(expected_losses, **EXACT)
    assert_same_adapter(trained_tensors(run_dir), expected_tensors)
    assert eval_losses(run_dir) == pytest.approx(expected_eval, **EXACT)
    log = run_dir.log.read_text()
    assert all(f"pipeline stage {stage} of 2 (replica {replica} of 2)" in log for stage in (0, 1) for replica in (0, 1))


@pytest.mark.slow
def test_a_resumed_replicated_pipeline_continues_exactly(replicated, reference):
    _, resumed = replicated
    assert losses(resumed)[STEPS:] == pytest.approx(reference[0][2:], **EXACT)
    assert_same_adapter(trained_tensors(resumed), reference[1])


def test_process_counts_that_are_not_replicas_of_the_stages_are_refused(small_data):
    config = config_for(small_data, 2).replace(distributed={"num_processes": 5})
    (problem,) = [p for p in validate(config) if p.where == "distributed.pipeline_stages"]
    assert "2 stages need a multiple of 2 processes, not 5" in problem.message
    assert "distributed.num_processes to 2, 4, 6" in problem.hint
    assert not [p for p in validate(config_for(small_data, 2, replicas=3)) if p.where == "distributed.pipeline_stages"]
    assert pipeline_layout(2, 4) == "2 pipeline replicas of 2 stages"
