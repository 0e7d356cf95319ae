"""Fixtures of the Python tests: the sparsecard binary, the bench helpers (LocalJob) and jobs of
real daemons on loopback that are always stopped (each daemon runs in its own process group)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCH = os.path.join(ROOT, "bench", "convergence")
sys.path.insert(0, BENCH)

from localjob import LocalJob  # noqa: E402


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo process group for the module's DDP tests (torch imported only here)."""
    import torch.distributed as dist
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def sparsecard():
    path = os.environ.get("SPARSECARD")
    if not path or not os.access(path, os.X_OK):
        pytest.skip("SPARSECARD (path of the sparsecard binary) is not set")
    return path


@pytest.fixture
def make_job(sparsecard, tmp_path):
    jobs = []

    def make(nodes=1, local_clients=1, daemon_args=()):
        job = LocalJob(sparsecard, nodes=nodes, local_clients=local_clients, daemon_args=daemon_args,
                       workdir=str(tmp_path / f"job{len(jobs)}"))
        os.makedirs(job.dir)
        jobs.append(job)
        job.start_daemons()
        return job

    yield make
    for job in jobs:
        killed = job.stop_all()
        assert not killed, f"daemons did not stop on SIGTERM: {killed}"
