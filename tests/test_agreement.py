"""The ranks' agreement on a configuration before they communicate (3 gloo processes).

The last rank differs from the others in one thing at a time; ``shard_state``,
``tree_all_reduce_mean`` and ``sharded_update`` must raise on every rank,
promptly (well before the collective timeout), naming the rank, the path and
both sides; an agreed configuration is compared once, not on every call.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._launch import launch_workers, results

pytestmark = pytest.mark.distributed

WORKER_FILE = Path(__file__).with_name("_agreement_workers.py")
LAUNCH_TIMEOUT_S = 240  # an upper bound for a slow shared machine, not a timing assertion
PROMPT_S = 10.0  # a refusal must come well before the workers' 60 s collective timeout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch_workers(WORKER_FILE, tmp_path_factory.mktemp("n3"), 3, LAUNCH_TIMEOUT_S, {})


FINGERPRINT_TEXTS = {
    ("shard_state", "shape"): ["state.params['w1']", "(7, 5)", "(7, 6)"],
    ("shard_state", "dtype"): ["state.params['s']", "torch.float32", "torch.float16"],
    ("shard_state", "tx"): ["state.tx.spec", "learning_rate", "0.01", "0.02"],
    ("shard_state", "structure"): ["state.params['extra']", "exists on rank 2"],
    ("tree_all_reduce_mean", "shape"): ["tree['w2']", "(5, 3)", "(5, 4)"],
    ("tree_all_reduce_mean", "dtype"): ["tree['b1']", "torch.float32"],
    ("tree_all_reduce_mean", "structure"): ["tree['extra']", "exists on rank 2"],
    ("tree_all_reduce_mean", "bucket_bytes"): ["argument bucket_bytes", "1024"],
    ("sharded_update", "tx"): ["state.tx.spec", "learning_rate", "0.02"],
    ("sharded_update", "grads_dtype"): ["grads['b1']", "torch.float32"],
    ("sharded_update", "comm_dtype"): ["argument comm_dtype", "torch.float32"],
    ("sharded_update", "bucket_bytes"): ["argument bucket_bytes", "64"],
    ("sharded_update", "placements"): ["state.master['b1']", "Replicate()", "Shard(dim=0)"],
}


def test_a_rank_with_another_configuration_makes_every_rank_raise_promptly(runs):
    for r, res in enumerate(results(runs, "fingerprint")):
        for case, texts in FINGERPRINT_TEXTS.items():
            message, seconds = res[case]
            assert message is not None, f"rank {r}: {case} did not raise"
            assert message.startswith("ValueError:") and "rank 2" in message, (r, case, message)
            for text in texts:
                assert text in message, (r, case, text, message)
            assert seconds < PROMPT_S, (r, case, seconds)


def test_the_agreement_runs_once_per_configuration(runs):
    for r, res in enumerate(results(runs, "fingerprint")):
        calls = res["calls"]
        assert calls["sharded_update_first"] >= 1 and calls["mean_first"] >= 1, (r, calls)
        assert calls["sharded_update_later"] == 0 and calls["mean_later"] == 0, (r, calls)
