"""Shared fixtures and settings for the test suite."""

import os

import pytest
import torch
from hypothesis import settings

from tests.helpers import IMPL_NAMES

# Keep the suite predictable on small shared machines: at most two threads, shared
# between pytest-xdist's workers (``-n``) when the tests run in several processes.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    # pytest-xdist's --dist loadscope deals the modules out in collection order
    # (see pytest_collection_modifyitems), not by their number of tests; this overrides
    # --loadscope-reorder (xdist's default) on the command line.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The modules that hold a ``slow`` or ``distributed`` test (minutes of processes and
    compiles) are collected first, each module's tests in their order.

    Under ``pytest-xdist``'s ``--dist loadscope`` a worker takes a whole module at a time,
    in collection order: with the long modules dealt out first, the many short ones even
    out the workers' loads at the end, where a long module dealt last would leave one
    worker running it alone.
    """

    def module(item) -> str:
        return item.nodeid.split("::")[0]

    long = {
        module(item)
        for item in items
        if any(mark.name in ("slow", "distributed") for mark in item.iter_markers())
    }
    items.sort(key=lambda item: module(item) not in long)  # stable: modules stay whole


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(params=IMPL_NAMES)
def impl(request):
    """Each implementation of the matrix (``tests/helpers.py``), by its ``impl`` name.

    Tests that run against every implementation take this fixture; a test that
    covers a subset parametrizes ``impl`` itself with ``helpers.implementations(where)``.
    """
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """Runs a module's tests on one thread: small kernels, no OpenMP oversubscription on busy machines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# optax's fixtures for transform tests: two parameter tensors and one step's updates.
@pytest.fixture
def init_params():
    return (torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))


@pytest.fixture
def per_step_updates():
    return (torch.tensor([500.0, 5.0]), torch.tensor([300.0, 3.0]))
