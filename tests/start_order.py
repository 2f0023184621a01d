"""The order tests start in on xdist workers (tests/conftest.py deals them at collection)."""

# The longest tests (seconds on 2 busy cores, `pytest --durations`, 2026-12-07), one line per group that must run on
# one worker or after one test of it (a module fixture, or a set-up built once per run that another worker would wait
# for). The groups start first, longest first, each on the least loaded worker, so that a run ends on short tests
# and not on one worker still busy with a long one while the other is idle; the tests not named here follow.
LONGEST_FIRST = (
    (123, "tests/test_study.py::test_tiny_set_in_two_budgeted_pieces_equals_one_piece_and_exports"),
    (92, "tests/test_cli.py::test_sweep_and_compare"),
    (83, "tests/test_mlflow_ui.py::test_experiment_opens_on_its_runs", "tests/test_mlflow_ui.py::test_run_page_shows_losses",
     "tests/test_mlflow_ui.py::test_heatmap_artifact_opens"),
    (54, "tests/test_fit_throughput.py::test_demo_fit_end_to_end"),
    (53, "tests/kernels/test_kernel_full_routing.py::test_sharp_softmax_chain_error_is_torch_fp32_sized"),
    (44, "tests/test_distributed.py::test_ddp_two_processes_reproduce_single_process_losses"),
    (43, "tests/test_mlflow_runs.py::test_ddp_on_cpu_with_a_fresh_sqlite_store_makes_one_run"),
    (42, "tests/test_mlflow_runs.py::test_two_processes_opening_a_fresh_sqlite_store_at_once_both_succeed"),
    (39, "tests/test_distributed.py::test_fsdp_sharding_gives_unsharded_gradients"),
    (20, "tests/kernels/test_kernel_block_routing.py::test_tiling_and_repeats_change_nothing"),
    (20, "tests/kernels/test_kernel_block_routing.py::test_wide_head_fp32_error_is_torch_fp32_sized"),
)


def xdist_chunk_sizes(n_items: int, n_workers: int) -> list[int]:
    """How many of the collected tests xdist's work-stealing scheduler first gives each worker: consecutive
    chunks of the collection, in these sizes (later an idle worker steals from the end of another's chunk)."""
    sizes = []
    for workers_left in range(n_workers, 0, -1):
        sizes.append((n_items - sum(sizes)) // workers_left)
    return sizes


def longest_first_chunks(items: list, workers: int) -> list[list]:
    """The named groups dealt to the workers' chunks longest first, each to the least loaded, its tests one after
    the other (pytest ends a module's fixtures when the next test is another module's); then the other tests in
    their order, to fill each chunk to its size."""
    groups, rest = {}, []
    for item in items:
        group = next((g for g in LONGEST_FIRST if any(item.nodeid.startswith(name) for name in g[1:])), None)
        (groups.setdefault(group, []) if group else rest).append(item)
    chunks, loads = [[] for _ in range(workers)], [0] * workers
    for group in sorted(groups, key=lambda g: -g[0]):
        least_loaded = loads.index(min(loads))
        chunks[least_loaded] += groups[group]
        loads[least_loaded] += group[0]
    for k, size in enumerate(xdist_chunk_sizes(len(items), workers)):
        if len(chunks[k]) > size and k + 1 < workers:  # the last tests go last on the next worker instead
            chunks[k + 1] += chunks[k][size:]
            del chunks[k][size:]
        fill = max(0, size - len(chunks[k]))
        chunks[k] += rest[:fill]
        rest = rest[fill:]
    chunks[-1] += rest
    return chunks
