"""The sweep on a local Ray runtime: each unit a task reserving its threads, outcomes streamed back, only the driver
writes. Through Ray and here, the same case set; a rerun through Ray skips everything."""
import pytest

from cpumoe.bench.results import ResultsDB, case_key
from cpumoe.cli import main

SWEEP = ["bench", "sweep", "layer", "--skeleton", "qwen3-30b-a3b", "--skeleton-shape", "64,32,4,2", "--hidden", "64",
         "--inter", "32,64", "--num-experts", "4", "--top-k", "1,2", "--tokens", "1,4", "--threads", "1"]


@pytest.fixture(scope="module")
def ray_runtime():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False)
    yield ray
    ray.shutdown()


def cases(path) -> set[str]:
    with ResultsDB(path) as db:
        return {case_key(r.case) for r in db.rows("layer")}


@pytest.mark.slow
def test_ray_sweep_matches_local_and_resumes(tmp_path, capsys, ray_runtime):
    on_ray, local = tmp_path / "ray.db", tmp_path / "local.db"
    assert main(SWEEP + ["--ray", "--db", str(on_ray)]) == 0
    assert "6 ok" in capsys.readouterr().out
    assert main(SWEEP + ["--db", str(local)]) == 0
    capsys.readouterr()
    assert cases(on_ray) == cases(local) and len(cases(on_ray)) == 6
    with ResultsDB(on_ray) as db:
        rows = db.rows("layer")
        assert {r.status for r in rows} == {"ok"} and all(r.machine_info["cores"] >= 1 for r in rows)
        assert all(r.bandwidth_gbs > 0 for r in rows)
    assert main(SWEEP + ["--ray", "--db", str(on_ray)]) == 0
    assert "6 skipped" in capsys.readouterr().out
    with ResultsDB(on_ray) as db:
        assert len(db.rows("layer")) == 6


@pytest.mark.slow
def test_ray_refuses_a_case_wider_than_every_node(tmp_path, ray_runtime):
    with pytest.raises(SystemExit, match="--threads 4 is more CPUs than any Ray node has"):
        main(SWEEP[:-1] + ["4", "--ray", "--db", str(tmp_path / "r.db")])


def test_ray_missing_is_a_clear_error(monkeypatch, tmp_path):
    import builtins
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(SystemExit, match=r"pip install cpumoe\[ray\]"):
        main(SWEEP + ["--ray", "--db", str(tmp_path / "r.db")])
