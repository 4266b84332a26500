"""Shared fixtures; every Python process a test starts runs this checkout's code."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, SHARED_TRACES


def pytest_configure(config: pytest.Config) -> None:
    """Put this checkout first on ``PYTHONPATH`` for every subprocess (``python -m pnpscale ...``), so that a
    second clone tests itself, not whichever ``pnpscale`` happens to be installed."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *rest])


#: Tests that are neither ``slow`` nor ``slurm`` yet take seconds (they start the CLI, a notebook or several
#: Python processes), left out of ``-m quick``: the function's node id without its parameters, or a whole file.
#: Measured with ``--durations=0`` file by file (benchmarks/README.md, "Test suite time"): every function one of
#: whose cases took 5 s or more on 2 cores under a load average of about 12 (a second or so on a quiet machine),
#: plus a few known from earlier runs. A new test of a second or more belongs here or under ``@pytest.mark.slow``.
HEAVY: frozenset[str] = frozenset({
    "tests/test_architecture.py::test_every_module_imports_in_a_fresh_interpreter",
    "tests/test_architecture.py::test_tiny_2d_overrides_still_compose",
    "tests/test_assignment.py::test_round_robin_matches_deepinv_local_indices",
    "tests/test_clocks.py::test_a_rank_clock_stepped_between_iterations_is_named_with_its_rank_and_a_bound_under_the_step",
    "tests/test_compare.py::test_every_chart_draws_a_varied_sweep_from_load",
    "tests/test_compare.py::test_example_notebook_runs_on_a_varied_sweep",
    "tests/test_compare.py::test_no_comparison_without_a_varied_key",
    "tests/test_compare.py::test_problem_and_num_operators_comparisons",
    "tests/test_compare.py::test_report_writes_comparison_and_transfer_knows_all_gather",
    "tests/test_compare.py::test_variant_discovered_from_run_json",
    "tests/test_config.py::test_cli_single_run_checks_the_composed_point_before_anything",
    "tests/test_config.py::test_cli_sweep_with_a_bad_composed_point_starts_nothing",
    "tests/test_config.py::test_every_typed_field_refuses_an_unconvertible_value_in_one_line",
    "tests/test_ct.py::test_split_is_exact_and_lipschitz_bounds_the_normal_operator",
    "tests/test_docs.py::test_a_pages_runnable_snippets_run",
    "tests/test_docs.py::test_the_docs_build_strict",
    "tests/test_faults.py::test_2_a_run_folder_in_use_is_refused_and_left_untouched",
    "tests/test_faults.py::test_4_a_damaged_point_is_unreadable_for_load_and_the_report_alike",
    "tests/test_faults.py::test_4_damaged_run_folders_are_reported_one_by_one",
    "tests/test_faults.py::test_4_every_damaged_file_of_a_run_folder_is_one_unreadable_point",
    "tests/test_faults.py::test_5_bad_input_is_refused_before_any_rank_starts",
    "tests/test_faults.py::test_5_command_line_faults_exit_2_with_one_line",
    "tests/test_faults.py::test_7_paths_that_leave_the_folder_are_refused_and_report_text_is_escaped",
    "tests/test_faults.py::test_8_a_failed_report_leaves_no_report_folder",
    "tests/test_gpu_path.py::test_a_fork_after_a_cuda_query_is_refused_by_the_rank",
    "tests/test_gpu_path.py::test_device_rule_is_deepinvs",
    "tests/test_gpu_path.py::test_the_forkserver_preload_never_touches_cuda",
    "tests/test_gradient_collective.py::test_layout_owns_every_pixel_once_and_holds_every_read_pixel",
    "tests/test_metrics.py::test_one_registry_of_measures_names_totals_and_per_iteration_values",
    "tests/test_overlap_pipelined.py::test_windows_equal_deepinvs_padded_slices",
    "tests/test_plugin_params.py::test_plugin_params_are_checked_by_their_class_before_any_rank",
    "tests/test_projection.py::test_command_on_cpu_runs_refuses_past_the_cores",
    "tests/test_projection.py::test_command_prints_both_crossovers",
    "tests/test_projection.py::test_command_projects_each_variant_of_a_sweep",
    "tests/test_projection.py::test_failed_command_leaves_the_report_as_it_was",
    "tests/test_projection.py::test_pipelined_variant_projected_with_the_held_hidden_share",
    "tests/test_projection.py::test_rebuilding_the_report_keeps_a_users_projection",
    "tests/test_projection.py::test_the_report_on_cpu_runs_says_it_does_not_project_past_the_cores",
    "tests/test_report.py::test_empty_folder_is_a_one_line_error",
    "tests/test_report.py::test_every_chart_is_a_png_and_readme_has_checks",
    "tests/test_report.py::test_example_notebook_runs_headless",
    "tests/test_report.py::test_newest_complete_run_wins_and_choice_is_printed",
    "tests/test_report.py::test_stored_sweeps_compose_and_expand",
    "tests/test_report.py::test_summary_numbers_equal_hand_computed",
    "tests/test_slurm.py::test_bad_slurm_points_stop_before_anything_is_submitted",
    "tests/test_slurm.py::test_completed_run_matches_on_the_stored_resolution_of_scale_auto",
    "tests/test_spread.py::test_load_carries_the_spread_and_the_report_says_too_few",
    "tests/test_trace_corruptions.py::test_a_lone_cpu_trace_cut_inside_its_last_iteration_is_named_not_read_as_complete",
    "tests/test_trace_corruptions.py::test_corruption_ends_in_the_numbers_a_refusal_or_a_named_anomaly",
    "tests/test_trace_properties.py::test_generated_traces_are_analysed_to_the_nanosecond",
    "tests/test_user_trial.py::test_a_run_folder_whose_record_disagrees_with_its_folder_is_unreadable",
})

#: Groups of tests that run one at a time on one xdist worker (see :func:`pytest_xdist_make_scheduler`): the
#: tests that compare a measurement with a job's own clock or an injected delay ("timing"), and the SLURM
#: tests ("slurm": one localhost cluster).
TIMING = (
    "tests/test_overlap_jobs.py",
    "tests/test_waits.py::test_injected_delay_shows_up_as_uneven_work_not_late_start",
    "tests/test_validate.py::test_suite_passes_on_cpu_ranks_and_fails_when_the_decomposition_is_broken",
    "tests/test_ct.py::test_angle_blocks_keep_the_gradient_balanced_where_two_operators_cannot",
)


#: Files whose module-scoped fixture is a real run (a CLI sweep, gloo ranks at several world sizes, a built
#: wheel, a drawn report): sent whole to one worker, so that the fixture runs once, not once per worker.
SHARED_RUN_FILES = (
    "tests/test_e2e.py",
    "tests/test_training_3d.py",
    "tests/test_analyze.py",
    "tests/test_wheel.py",
    "tests/test_denoiser_collective.py",
    "tests/test_gradient_collective.py",
    "tests/test_overlap_pipelined.py",
    "tests/test_report.py",
)


def _function_id(item: pytest.Item) -> str:
    return item.nodeid.split("[", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the quick subset (``-m quick``: not slow, not slurm, not :data:`HEAVY`)."""
    for item in items:
        fid, path = _function_id(item), item.nodeid.split("::", 1)[0]
        if item.get_closest_marker("slow") is None and item.get_closest_marker("slurm") is None:
            if fid not in HEAVY and path not in HEAVY:
                item.add_marker(pytest.mark.quick)


def run_group(nodeid: str) -> str | None:
    """The group a test runs in, one at a time with the others of it on one worker: ``"slurm"``
    (tests/test_slurm.py), ``"timing"`` (:data:`TIMING`), its file (:data:`SHARED_RUN_FILES`), else ``None``
    (any worker, any time).

    >>> run_group("tests/test_slurm.py::test_x[2]"), run_group("tests/test_overlap_jobs.py::test_y")
    ('slurm', 'timing')
    >>> run_group("tests/test_e2e.py::test_z"), run_group("tests/test_metrics.py::test_w")
    ('tests/test_e2e.py', None)
    """
    fid, path = nodeid.split("[", 1)[0], nodeid.split("::", 1)[0]
    if path == "tests/test_slurm.py":
        return "slurm"
    if any(fid == t or path == t for t in TIMING):
        return "timing"
    return path if path in SHARED_RUN_FILES else None


if importlib.util.find_spec("xdist") is not None:  # the test extra has it; without it pytest runs in one process

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """``--dist load`` with :func:`run_group`'s groups each sent whole to one worker (pytest-xdist's own
        ``--dist loadgroup`` reads ``xdist_group`` marks through a node id that pytest 9 no longer lets it change).
        """
        if config.getvalue("dist") != "load":
            return None  # another --dist asked for: xdist's own
        from xdist.scheduler import LoadScopeScheduling

        class GroupedLoad(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return run_group(nodeid) or nodeid

        return GroupedLoad(config, log)


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """The real Kineto traces of ../shared/traces/hta (skipped where that folder is absent)."""
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"real traces not present at {SHARED_TRACES} (../shared/traces is outside the repo)")
    return SHARED_TRACES


#: tests/data holds inputs (trace generators among them), not tests: never collected, doctests included
#: (two generators named make_case.py would otherwise collide as one module name).
collect_ignore_glob = ["data/*"]
