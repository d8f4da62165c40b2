"""[rollout] sampling fields reach the SamplingParams the generators use (asyncrl.deploy.build.training_sampling)."""

from __future__ import annotations

from asyncrl.config import load_config
from asyncrl.deploy.build import training_sampling


def write(tmp_path, extra: str = ""):
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    path = tmp_path / "config.toml"
    path.write_text(f"""
[model]
path = "{tmp_path / 'model'}"
[model.build_tiny]
hidden_size = 32
num_heads = 4
num_kv_heads = 2
[data]
path = "{tmp_path / 'train.jsonl'}"
[rollout]
group_size = 4
max_new_tokens = 7
{extra}
[trainer]
prompts_per_step = 4
micro_batch_size = 4
""")
    return path


def test_rollout_ignore_eos_reaches_the_training_sampling_params(tmp_path):
    params = training_sampling(load_config(write(tmp_path, "ignore_eos = true\nstop_token_ids = [3]")))
    assert params.ignore_eos is True and params.stop_token_ids == [3] and params.max_new_tokens == 7
    assert params.n == 4
    assert training_sampling(load_config(write(tmp_path))).ignore_eos is False


def test_cluster_affinity_is_checked_against_this_machine(tmp_path):
    import os

    import pytest

    from asyncrl.config import ConfigError

    count = os.cpu_count() or 1
    cfg = load_config(write(tmp_path), [f"cluster.affinity.trainer=[{count - 1}]"])
    assert cfg.cluster.affinity.trainer == [count - 1] and cfg.cluster.affinity.generator == []
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path), [f"cluster.affinity.generator=[0, {count + 3}]"])
    assert any(f"cluster.affinity.generator: CPU {count + 3} does not exist" in e for e in exc.value.errors)
    with pytest.raises(ConfigError):
        load_config(write(tmp_path), ["cluster.affinity.scorer=[-1]"])


def test_pin_cpus_pins_every_thread_and_names_the_role_on_error():
    import contextlib
    import os
    import threading

    import pytest

    from asyncrl.deploy.auto import pin_cpus

    before = os.sched_getaffinity(0)
    cpu = min(before)
    started, stop = threading.Event(), threading.Event()

    def worker():
        started.set()
        stop.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    started.wait(5)
    try:
        pin_cpus([cpu], "trainer")
        assert os.sched_getaffinity(0) == {cpu}
        assert os.sched_getaffinity(t.native_id) == {cpu}  # a thread that already existed too
        pin_cpus([], "trainer")  # empty: nothing changes
        assert os.sched_getaffinity(0) == {cpu}
        with pytest.raises(RuntimeError, match=r"cluster.affinity.scorer = \[100000\]"):
            pin_cpus([100000], "scorer")
    finally:
        stop.set()
        t.join()
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(tid), before)
