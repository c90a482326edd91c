from types import SimpleNamespace

from kvgate.cluster.autoscale import desired_replicas, kv_aware_policy


def test_the_queue_sets_the_count_while_kv_is_low() -> None:
    assert desired_replicas(2, requests=40, kv_usage=[0.2, 0.3], target_requests=8) == 5
    assert desired_replicas(4, requests=3, kv_usage=[0.1] * 4, target_requests=8) == 1


def test_a_nearly_full_kv_pool_adds_a_replica_and_a_busy_one_holds() -> None:
    assert desired_replicas(2, requests=4, kv_usage=[0.9, 0.95], target_requests=8) == 3
    assert desired_replicas(3, requests=4, kv_usage=[0.7, 0.7, 0.7], target_requests=8) == 3
    assert desired_replicas(2, requests=100, kv_usage=[0.9, 0.9], target_requests=8) == 13


def test_the_policy_stays_within_the_bounds() -> None:
    ctx = SimpleNamespace(
        aggregated_metrics={"kv_usage": {"a": 0.99, "b": 0.99}},
        config=SimpleNamespace(target_ongoing_requests=8),
        current_num_replicas=2,
        total_num_requests=2.0,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=2,
        policy_state={"k": 1},
    )
    assert kv_aware_policy(ctx) == (2, {"k": 1})  # wants 3, may have 2
    ctx.aggregated_metrics = None
    ctx.total_num_requests = 0.0
    assert kv_aware_policy(ctx)[0] == 1


def test_the_deployment_names_a_policy_ray_resolves() -> None:
    import pytest

    pytest.importorskip("ray")
    from ray.serve.config import AutoscalingConfig

    from kvgate.cluster.app import ClusterSpec, application

    app = application(ClusterSpec(("--model", "smollm2"), replicas=1, max_replicas=3))
    engine = app._bound_deployment.init_args[0]  # the ingress's argument: the engine
    config = AutoscalingConfig(
        **engine._bound_deployment._deployment_config.autoscaling_config.model_dump()
    )
    policy = config.policy.get_policy()  # Ray's (cloudpickled) copy of it
    assert (policy.__module__, policy.__name__) == ("kvgate.cluster.autoscale", "kv_aware_policy")
    assert engine._bound_deployment._deployment_config.autoscaling_config.max_replicas == 3
