"""GPU claims for shard jobs that see more GPUs than they asked for (mirageflow.cluster.gpu_claim).

Fake GPU indices and lock files in tmp_path: no GPU or NVML needed. flock locks of two
open descriptors conflict even inside one process, so one test process can play several
shard jobs; a subprocess checks that a job's claim ends with the job.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from mirageflow.stats import gpu
from mirageflow.cluster import gpu_claim
from mirageflow.stats import formulas as stats
from mirageflow.cluster.gpu_claim import GpuClaimError, claim_for_job, claim_gpus

EIGHT = [str(i) for i in range(8)]


def test_each_job_gets_the_first_free_gpu(tmp_path):
    claims = [claim_gpus(EIGHT, 1, tmp_path) for _ in range(8)]
    assert [c.devices for c in claims] == [[str(i)] for i in range(8)]
    with pytest.raises(GpuClaimError, match=r"no 1 free GPU\(s\) among the 8 visible"):
        claim_gpus(EIGHT, 1, tmp_path)
    claims[3].release()  # a job ends: its GPU is the next one handed out
    assert claim_gpus(EIGHT, 1, tmp_path).devices == ["3"]


def test_multi_gpu_claims_take_disjoint_sets(tmp_path):
    a, b = claim_gpus(EIGHT, 2, tmp_path), claim_gpus(EIGHT, 4, tmp_path)
    c = claim_gpus(EIGHT, 2, tmp_path)
    assert (a.devices, b.devices, c.devices) == (["0", "1"], ["2", "3", "4", "5"], ["6", "7"])
    assert set(a.devices).isdisjoint(b.devices) and set(b.devices).isdisjoint(c.devices)


def test_a_partial_set_is_never_held(tmp_path):
    first = claim_gpus(["0", "1", "2"], 2, tmp_path)  # 0 and 1
    with pytest.raises(GpuClaimError, match="held: 0 .*, 1 "):
        claim_gpus(["0", "1", "2"], 2, tmp_path)
    assert claim_gpus(["0", "1", "2"], 1, tmp_path).devices == ["2"]  # GPU 2 was let go again
    first.release()


def test_waits_for_a_gpu_to_come_free(tmp_path):
    held = claim_gpus(["0", "1"], 2, tmp_path)
    ticks = []

    def sleep(seconds):  # a job finishes while the second one waits
        ticks.append(seconds)
        if len(ticks) == 3:
            held.release()

    now = iter(range(1000))
    claim = claim_gpus(["0", "1"], 1, tmp_path, wait_seconds=10, poll_seconds=1, clock=lambda: next(now), sleep=sleep)
    assert claim.devices == ["0"] and ticks == [1, 1, 1]


def test_gives_up_after_the_wait_naming_the_holder(tmp_path):
    held = claim_gpus(["0"], 1, tmp_path)
    now = iter(range(0, 1000, 5))
    with pytest.raises(GpuClaimError, match=r"after 12s; held: 0 \(host \S+ pid \d+"):
        claim_gpus(["0"], 1, tmp_path, wait_seconds=12, clock=lambda: next(now), sleep=lambda s: None)
    held.release()


def test_keys_name_the_lock_files(tmp_path):
    claim = claim_gpus(["0", "1"], 1, tmp_path, keys=["GPU-aaaa", "GPU-bbbb"])
    assert claim.paths == [tmp_path / "mirageflow-gpu-GPU-aaaa.lock"] and claim.devices == ["0"]
    # another job numbering the same GPUs differently still skips GPU-aaaa
    assert claim_gpus(["1", "0"], 1, tmp_path, keys=["GPU-aaaa", "GPU-bbbb"]).devices == ["0"]


@pytest.mark.parametrize("count, visible", [(0, EIGHT), (9, EIGHT), (1, [])])
def test_impossible_claims_are_refused(tmp_path, count, visible):
    with pytest.raises(ValueError):
        claim_gpus(visible, count, tmp_path)


def test_the_claim_ends_with_the_process(tmp_path):
    code = textwrap.dedent(f"""
        import os, sys
        from mirageflow.cluster.gpu_claim import claim_gpus
        claim = claim_gpus(["0"], 1, {str(tmp_path)!r})
        print(claim.devices[0], flush=True)
        os._exit(0)  # no release(): the kernel drops the flock
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"
    assert claim_gpus(["0"], 1, tmp_path).devices == ["0"]


# --------------------------------------------------------------------------- the job's view


def test_job_claim_sets_cuda_visible_devices_and_counts(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    other = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    claim = claim_for_job(1, env, lock_dir=tmp_path, nvml=False)
    claim2 = claim_for_job(2, other, lock_dir=tmp_path, nvml=False)
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and other["CUDA_VISIBLE_DEVICES"] == "1,2"
    # num_gpus in the report and the GPUs the NVML sampler resolves: only the claimed ones
    assert stats.allocated_gpus(env) == 1 and stats.allocated_gpus(other) == 2
    assert gpu.visible_entries(other) == ["1", "2"]
    claim.release(), claim2.release()


@pytest.mark.parametrize(
    "env, count",
    [({"CUDA_VISIBLE_DEVICES": "0,1"}, 2), ({"CUDA_VISIBLE_DEVICES": "3"}, 1), ({"CUDA_VISIBLE_DEVICES": "0,1"}, 0), ({}, 1)],
)
def test_nothing_to_claim(tmp_path, env, count):
    """As many GPUs as asked for (SLURM gave the job its own), none asked for, or none seen."""
    before = dict(env)
    assert claim_for_job(count, env, lock_dir=tmp_path, nvml=False) is None
    assert env == before and not list(tmp_path.iterdir())


def test_slurm_jobs_scope_index_locks_by_allocation(tmp_path):
    """Two allocations on one node may both number their GPUs from 0 (cgroups): no clash."""
    a = {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_ID": "11"}
    b = {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_ID": "12"}
    assert claim_for_job(1, a, lock_dir=tmp_path, nvml=False).devices == ["0"]
    assert claim_for_job(1, b, lock_dir=tmp_path, nvml=False).devices == ["0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mirageflow-gpu-slurm11-0.lock", "mirageflow-gpu-slurm12-0.lock"]


class _FakeNVML:
    """Enough of pynvml for naming GPUs: index -> handle -> UUID."""

    def __init__(self, uuids):
        self.uuids = uuids

    def nvmlDeviceGetCount(self):
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.uuids[i]

    def nvmlDeviceGetUUID(self, handle):
        return handle


def test_without_cuda_visible_devices_nvml_gpus_are_claimed_by_uuid(tmp_path):
    nv = _FakeNVML(["GPU-aa", "GPU-bb", "GPU-cc"])
    env, env2 = {}, {}
    claim_for_job(1, env, lock_dir=tmp_path, nvml=nv)
    claim_for_job(2, env2, lock_dir=tmp_path, nvml=nv)
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-aa"} and env2 == {"CUDA_VISIBLE_DEVICES": "GPU-bb,GPU-cc"}


def test_indices_are_locked_by_uuid_when_nvml_knows_them(tmp_path):
    nv = _FakeNVML(["GPU-aa", "GPU-bb"])
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_ID": "7"}
    claim = claim_for_job(1, env, lock_dir=tmp_path, nvml=nv)
    assert claim.keys == ["GPU-aa"] and env["CUDA_VISIBLE_DEVICES"] == "0"


def test_lock_dir_and_wait_from_the_environment(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "0,1", gpu_claim.LOCK_DIR_ENV: str(tmp_path / "locks"), gpu_claim.WAIT_ENV: "0"}
    claim_for_job(1, dict(env), nvml=False)
    claim_for_job(1, dict(env), nvml=False)
    with pytest.raises(GpuClaimError, match="after 0s"):
        claim_for_job(1, dict(env), nvml=False)
    assert len(list((tmp_path / "locks").iterdir())) == 2


def test_claim_for_shard_uses_the_shards_gpu_count(tmp_path):
    from mirageflow.config import load_config

    data = tmp_path / "in.jsonl"
    data.write_text('{"q": "x"}\n')
    raw = {
        "processors": [{"type": "llm", "server_args": {"model_path": "org/model", "tp_size": 2}}],
        "loading_params": {"datasets": [{"path": str(data), "type": "jsonl", "output_dir": str(tmp_path / "out")}]},
        "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "a", "prompt": "{{ q }}"}]},
    }
    cfg = load_config(raw, environ={})
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    claim = gpu_claim.claim_for_shard(cfg, env, lock_dir=tmp_path / "locks", nvml=False)
    assert claim.devices == ["0", "1"] and env["CUDA_VISIBLE_DEVICES"] == "0,1"
