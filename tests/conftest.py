"""Test-wide settings: offline, no W&B, few threads."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
_wandb_tmp = tempfile.mkdtemp(prefix="flowgrpo-wandb-")
for _var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR"):
    os.environ.setdefault(_var, _wandb_tmp)

# pyproject.toml's addopts run the suite on 2 pytest-xdist workers (one per core of the machine it is sized for); each
# worker, and every process a test starts, computes on one thread, so that threads never outnumber cores (an OpenMP
# thread that spins waiting for a busy core slows a run many times over). Run alone (-n 0), a test gets 2 threads.
from twins import suite_threads  # noqa: E402  (tests/twins.py; imports no torch)

if suite_threads() == 1:
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(suite_threads())


@pytest.fixture
def one_thread():
    """Run a test on one torch thread, restoring the count after (``pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def flowgrpo_caplog(caplog):
    """``caplog`` that sees the ``flowgrpo`` logger's records. That logger does not propagate to the root logger
    (where ``caplog`` listens) once ``flowgrpo.runlog`` is imported — any trainer test imports it at collection —
    and an in-process Hydra run turns propagation back on; so a test of what ``flowgrpo`` logs turns it on itself."""
    import logging

    log = logging.getLogger("flowgrpo")
    saved = log.propagate
    log.propagate = True
    yield caplog
    log.propagate = saved


def pytest_collection_modifyitems(session, config, items):
    """The preset tripwire first: its file is the longest one (three short training runs), and the workers take
    whole files in collection order (``--dist loadfile``), so started last it ran alone at the end."""
    items.sort(key=lambda item: item.nodeid.split("::")[0] != "tests/test_tripwire.py")
