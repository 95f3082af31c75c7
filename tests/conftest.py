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
