"""rollout.fleet_resources against a Ray cluster's totals: what one actor asks that no cluster of these totals has.
A local cluster verlj starts cannot grow, so the fleet refuses such a config at once instead of waiting for actors
Ray never places (engine/rl/fleet.py, RayFleet._start)."""

from verlj.engine.rl.fleet import unplaceable

CPU_MACHINE = {"CPU": 2.0, "memory": 8e9, "object_store_memory": 2.7e8, "node:127.0.0.1": 1.0}


def test_a_gpu_actor_on_a_cluster_without_gpus_is_named_with_what_the_cluster_has():
    assert unplaceable({"num_gpus": 1}, CPU_MACHINE) == "num_gpus: 1 (the cluster has 0)"
    assert unplaceable({"num_cpus": 1, "num_gpus": 0.5, "tpu_v5": 4}, CPU_MACHINE) == \
        "num_gpus: 0.5 (the cluster has 0), tpu_v5: 4 (the cluster has 0)"


def test_what_fits_is_not_named():
    assert unplaceable({"num_cpus": 2}, CPU_MACHINE) == ""
    assert unplaceable({"num_cpus": 1, "memory": 8e9, "num_gpus": 0}, CPU_MACHINE) == ""
    assert unplaceable({"num_gpus": 1, "num_cpus": 4}, {"CPU": 64.0, "GPU": 8.0}) == ""
    assert unplaceable({"num_cpus": 3}, CPU_MACHINE) == "num_cpus: 3 (the cluster has 2)"


def test_an_envs_own_module_ships_to_the_actors_and_an_installed_one_does_not(tmp_path, monkeypatch):
    """rollout.env on a fleet: the top-level module of the user's code the actors import (a module:Class env's, a TRL
    class's, an OpenEnv env's adapter; a file here) goes to the actors through Ray's runtime env (py_modules); built-ins,
    verlj's own, installed modules (the standard library) and an OpenEnv env without an adapter ship nothing."""
    from verlj.engine.config import RolloutConfig
    from verlj.engine.rl.fleet import shipped_env

    def ship(env, adapter=None):
        return shipped_env(RolloutConfig(env=env, openenv_adapter=adapter))

    (tmp_path / "my_fleet_envs.py").write_text("class Env:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for env, adapter in (("my_fleet_envs:Env", None), ("trl:my_fleet_envs:Env", None), ("openenv:http://127.0.0.1:8765", "my_fleet_envs:Env")):
        got = ship(env, adapter)["runtime_env"]["py_modules"]
        assert [m.__name__ for m in got] == ["my_fleet_envs"] and got[0].__file__ == str(tmp_path / "my_fleet_envs.py"), env
    assert ship(None) == ship("builtin:guess") == ship("verlj.engine.rl.envs:Guess") == ship("openenv:http://127.0.0.1:8765") == {}
    assert ship("json.decoder:JSONDecoder") == ship("trl:json.decoder:JSONDecoder") == {}
