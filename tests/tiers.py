"""The two tiers of the suite, in one place (a pytest plugin: ``-p tiers`` in pyproject.toml).

* Fast (``make test-fast`` = ``pytest -m "not slow"``): no model is loaded, no Python process or browser is
  started. The scheduler, policies, allocators, sampler, kernels, attention backends, the simulator, metrics,
  records, config checks and error lines, in minutes.
* Slow (the rest; ``make test`` runs both): everything that loads model weights (the session's ``llm`` and the
  transformers reference, tiny random models, tensor-parallel workers), runs ``python -m nanovllm.run`` or
  another Python process, or drives a browser.

A test is slow when it uses a fixture that loads the model (``MODEL_FIXTURES``, found by pytest's own fixture
closure, so a fixture built on them counts too), when it or its module is listed in ``SLOW`` with the reason
(one table, so the tiers are read and changed in one place), or when it carries ``@pytest.mark.slow`` itself. The table is checked, not trusted: a test left in
the fast tier that loads model weights or starts a process (a Python one, a browser) fails, saying so.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

MODEL_FIXTURES = {"llm", "hf_model", "hf_greedy"}

# What else is slow, and why: a whole module ("test_x.py") or one test of it ("test_x.py::test_name", every
# parametrization). The tests not named here run in the fast tier.
SLOW = {
    # the real model, loaded by the module's own engines or fixtures
    "test_contracts.py": "every plugin serves prompts on the real model, against transformers",
    "test_logprobs.py": "logprobs of the real model",
    "test_models.py": "tiny random models of each architecture, loaded by the engine",
    "test_model_seam.py::test_a_plugin_file_registers_an_architecture_that_the_engine_then_runs":
        "tiny random models, loaded by the engine",
    "test_decoder_stack.py": "the real model's fast paths and tiny models, stack against Python loop",
    "test_serving.py": "the serving loop on a real engine (a module fixture)",
    "test_soak.py": "thousands of requests through a real engine",
    "test_abort.py::test_an_interrupted_generate_leaves_the_engine_clean_and_usable": "a real engine",
    "test_engine.py::test_a_request_larger_than_the_whole_cache_is_rejected": "a real engine",
    "test_warmup.py::test_first_steps_of_a_run_are_no_slower_than_the_same_steps_later": "real engines",
    "test_faults.py::test_a_truncated_cached_conversion_is_recreated_from_the_gguf": "converts the GGUF again",
    # a Python process (python -m nanovllm.run, lint-imports, a wheel install, launchers, TP workers)
    "test_run.py::test_single_run_writes_its_files": "python -m nanovllm.run",
    "test_run.py::test_multirun_summary_table_and_shared_wandb_group": "a multirun",
    "test_run.py::test_multirun_with_failing_jobs_runs_them_all_and_exits_non_zero": "a multirun",
    "test_run.py::test_user_policy_example_runs_from_plugins": "python -m nanovllm.run",
    "test_run.py::test_bad_input_fails_before_the_model_loads_with_one_line": "python -m nanovllm.run",
    "test_run.py::test_policy_that_raises_is_one_error_line": "python -m nanovllm.run",
    "test_run.py::test_unknown_group_option_is_one_error_line": "python -m nanovllm.run",
    "test_run.py::test_trace_file_of_the_wrong_schema_is_one_line_naming_file_and_field": "python -m nanovllm.run",
    "test_run.py::test_full_traceback_with_hydra_full_error": "python -m nanovllm.run",
    "test_run.py::test_runs_from_an_installed_wheel": "a wheel built and installed",
    "test_interrupt.py": "signals sent to python -m nanovllm.run subprocesses",
    "test_layering.py": "lint-imports runs on copies of the tree",
    "test_viz.py::test_cli_single_run_writes_pngs_and_report": "python -m nanovllm.viz",
    "test_viz.py::test_cli_compares_runs_into_out_dir": "python -m nanovllm.viz",
    "test_engine.py::test_validate_command_reports_agreement": "python -m nanovllm.validate",
    "test_faults.py::test_an_allocator_that_raises_mid_run_is_one_error_line_and_every_request_is_written":
        "python -m nanovllm.run",
    "test_faults.py::test_an_unwritable_run_directory_is_one_error_line": "python -m nanovllm.run",
    "test_faults.py::test_a_truncated_gguf_through_the_cli_is_one_error_line": "python -m nanovllm.run",
    "test_config_errors.py::test_the_command_line_refuses_flashinfer_on_cpu_before_the_model_loads":
        "python -m nanovllm.run",
    "test_live.py::test_bad_run_dirs_say_what_is_wrong": "python -m nanovllm.viz --live",
    "test_loggers.py::test_wandb_offline_run_holds_config_history_summary_and_table": "wandb's own processes",
    "test_loggers.py::test_wandb_run_summary_holds_the_speculative_decoding_figures": "wandb's own processes",
    "test_kernels.py::test_a_build_killed_mid_way_does_not_block_the_next_start": "kernel builds in processes",
    "test_kernels.py::test_a_start_that_waits_for_another_build_says_so_once": "kernel builds in processes",
    "test_kernels.py::test_a_library_another_process_is_still_linking_is_never_loaded": "kernel builds in processes",
    "test_kernels.py::test_bf16_brgemm_under_a_forced_lower_level_is_refused_not_an_abort":
        "a process started under a forced ISA level (oneDNN reads the cap once)",
    "test_sweep_launchers.py::test_joblib_runs_jobs_in_parallel_with_a_fair_share_of_threads": "a sweep",
    "test_sweep_launchers.py::test_submitit_local_runs_the_sweep": "a sweep",
    "test_sweep_launchers.py::test_ray_launcher_on_a_local_instance": "a sweep on Ray",
    "test_sweep_launchers.py::test_optuna_tunes_toward_the_objective_and_survives_failed_trials": "a sweep",
    "test_sweep_launchers.py::test_sweeper_direction_must_match_the_objective": "a sweep",
    "test_tensor_parallel.py::test_workers_end_with_the_engine": "tensor-parallel workers, in a subprocess",
    "test_tensor_parallel.py::test_ctrl_c_stops_the_driver_and_its_workers": "tensor-parallel workers, in a subprocess",
    "test_tensor_parallel.py::test_a_dead_worker_ends_the_run_with_an_error_naming_it": "tensor-parallel workers",
    "test_sim.py::test_a_real_run_records_its_machine_and_calibrate_cli_checks_its_arguments": "the CLI",
    "test_sim.py::test_calibrate_cli_refuses_a_negative_kernel_switch": "the calibrate CLI",
    "test_sim.py::test_cli_bad_step_time_model_is_one_error_line": "the CLI",
    "test_sim.py::test_cli_no_shipped_profile_for_the_model_is_one_error_line": "the CLI",
    "test_sim.py::test_cli_simulates_many_requests_and_writes_the_run_files": "the CLI",
    "test_sim.py::test_cli_simulation_on_another_machines_profile_prints_and_logs_one_line": "the CLI",
    "test_server_process.py": "python -m nanovllm.serve subprocesses",
    "test_ray_cluster.py": "starts Ray and real replicas (Ray actors that load the model), and python -m nanovllm.run",
    "test_ray_disaggregated.py": "starts Ray and a prefill and a decode replica (Ray actors that load the model)",
    "test_ray_faults.py": "starts Ray and real replicas, kills and relaunches their actors (each loads the model)",
    "test_ray_kv_tiers.py": "starts Ray and real replicas with KV tiers (Ray actors that load the model)",
    "test_ray_hang.py": "python -m nanovllm.run on Ray, a replica hangs and is killed",
    "test_ray_chaos.py": "python -m nanovllm.serve on Ray, replicas killed at random and relaunched (each loads the model)",
    "test_server_faults.py::test_a_request_past_its_timeout_is_aborted_with_a_408_error_object_and_its_blocks_freed":
        "a server over the real model",
    "test_server_faults.py::test_a_bad_timeout_is_a_400_naming_the_field": "a server over the real model",
    "test_server_faults.py::test_a_stopping_server_drains_its_requests_in_flight_then_aborts_what_is_left":
        "servers over the real model",
    "test_tensor_parallel.py::test_a_script_without_the_main_guard_gets_one_error_naming_it":
        "a script that starts tensor-parallel workers, in a subprocess",
    # a browser
    "test_live.py::test_watch_a_real_run_in_headless_chromium": "headless Chromium",
    "test_live.py::test_watch_speculative_decoding_in_headless_chromium": "headless Chromium",
}

# Programs a fast test may start: the C++ toolchain that builds the kernels on a fresh machine, and fontconfig's
# fc-list, which matplotlib runs once on a fresh machine to build its font cache (the first test that plots).
TOOLCHAIN = {"c++", "g++", "gcc", "cc", "ninja", "which", "fc-list"}


def is_slow(item: pytest.Item) -> bool:
    module = Path(str(item.fspath)).name
    test = f"{module}::{getattr(item, 'originalname', item.name)}"
    return bool(MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))) or module in SLOW or test in SLOW


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)


class FastTierViolation(AssertionError):
    """A test of the fast tier did what only slow tests may."""


def _refuse(what: str) -> None:
    raise FastTierViolation(f"a fast-tier test {what}: mark it slow (tests/tiers.py SLOW)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Around a fast test's whole run (its fixtures too, whatever their scope): loading model weights or starting
    a process other than the C++ toolchain fails it."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    from nanovllm.models import loader

    def no_weights(*args, **kwargs):
        _refuse("loaded model weights")

    class ToolchainOnly(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            program = str(args if isinstance(args, (str, bytes)) else args[0])
            name = Path(program.split()[0] if kwargs.get("shell") else program).name
            if name not in TOOLCHAIN or Path(program) == Path(sys.executable):
                _refuse(f"started a process ({name})")
            super().__init__(args, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "load_weights", no_weights)
        patch.setattr(subprocess, "Popen", ToolchainOnly)
        yield
