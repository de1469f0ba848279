"""Built-in policies: action shapes and ranges, epsilon, stable state_dict names."""
from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from ingestd.collect.interfaces import EnvSpec, Policy
from ingestd.collect.policies import MLP, QNetwork, Random, mlp_qnet

CARTPOLE = EnvSpec((4,), torch.float32, (), torch.int64, 2)
PIXELS = EnvSpec((4, 84, 84), torch.uint8, (), torch.int64, 6)
SIX = EnvSpec((2,), torch.float32, (), torch.int64, 6)
CONTINUOUS = EnvSpec((3,), torch.float32, (1,), torch.float32, None)


def root(spec: EnvSpec, n: int, seed: int = 0) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    if spec.observation_dtype == torch.uint8:
        obs = torch.randint(0, 256, (n, *spec.observation_shape), generator=gen, dtype=torch.uint8)
    else:
        obs = torch.randn((n, *spec.observation_shape), generator=gen)
    return TensorDict({"observation": obs}, batch_size=[n])


POLICIES = [
    ("Random", CARTPOLE, lambda s: Random(s, seed=1)),
    ("Random", PIXELS, lambda s: Random(s, seed=1)),
    ("MLP", CARTPOLE, lambda s: MLP(s, seed=1)),
    ("MLP", PIXELS, lambda s: MLP(s, hidden=(16,), seed=1)),
    ("MLP-eps", PIXELS, lambda s: MLP(s, hidden=(8,), epsilon=1.0, seed=1)),
]


@pytest.mark.parametrize("name, spec, make", POLICIES, ids=[f"{p[0]}-{p[1].num_actions}" for p in POLICIES])
def test_actions_are_int64_indices_in_range(name, spec, make):
    policy = make(spec)
    assert isinstance(policy, Policy)
    td = root(spec, 256)
    out = policy(td)
    action = out["action"]
    assert out is td and action.shape == (256,) and action.dtype == torch.int64
    assert action.min() >= 0 and action.max() < spec.num_actions
    assert not action.requires_grad


@pytest.mark.parametrize("seed", [0, 5])
def test_random_is_uniform_and_seeded(seed):
    policy = Random(SIX, seed=seed)
    draws = torch.cat([policy(root(SIX, 1000))["action"] for _ in range(3)])
    counts = torch.bincount(draws, minlength=6)
    assert counts.min() > 400 and counts.max() < 600
    again = Random(SIX, seed=seed)(root(SIX, 1000))["action"]
    assert torch.equal(again, draws[:1000]) and not torch.equal(draws[:1000], draws[1000:2000])
    assert not isinstance(policy, torch.nn.Module)  # it takes no weights


BOUNDED = EnvSpec((3,), torch.float32, (2,), torch.float32, None, action_low=(-2.0, 0.0), action_high=(2.0, 0.5))


def test_random_draws_bounded_continuous_actions_uniformly():
    """The warm-up of a SAC setup (TorchRL's RandomPolicy(action_spec)): uniform within the
    env's bounds, float32 [B, *action_shape], reproducible from the seed."""
    actions = Random(BOUNDED, seed=5)(root(BOUNDED, 20_000))["action"]
    assert actions.shape == (20_000, 2) and actions.dtype == torch.float32
    low, high = torch.tensor([-2.0, 0.0]), torch.tensor([2.0, 0.5])
    assert bool(((actions >= low) & (actions <= high)).all())
    quarters = ((actions - low) / (high - low) * 4).long().clamp(0, 3)
    for k in range(2):
        counts = torch.bincount(quarters[:, k], minlength=4)
        assert counts.min() > 4_500 and counts.max() < 5_500, counts
    assert torch.equal(Random(BOUNDED, seed=5)(root(BOUNDED, 20_000))["action"], actions)


@pytest.mark.parametrize("low, high, why", [((-1.0,), (1.0,), "one per element"),
                                            ((-math.inf, 0.0), (1.0, 1.0), "finite bounds"),
                                            ((1.0, 0.0), (0.0, 1.0), "low <= high")])
def test_random_refuses_bounds_it_cannot_draw_from(low, high, why):
    spec = EnvSpec((3,), torch.float32, (2,), torch.float32, None, action_low=low, action_high=high)
    with pytest.raises(ValueError, match=why):
        Random(spec)


@pytest.mark.parametrize("factory", [Random, MLP])
def test_continuous_action_spaces_are_refused(factory):
    with pytest.raises(ValueError, match="discrete action space"):
        factory(CONTINUOUS)


@pytest.mark.parametrize("epsilon, greedy_share", [(0.0, (1.0, 1.0)), (0.5, (0.6, 0.9)), (1.0, (0.35, 0.65))])
def test_epsilon_greedy(epsilon, greedy_share):
    policy = MLP(CARTPOLE, epsilon=epsilon, seed=3)
    td = root(CARTPOLE, 4000)
    greedy = policy.q_values(td["observation"]).argmax(-1)
    share = (policy(td)["action"] == greedy).float().mean().item()
    assert greedy_share[0] <= share <= greedy_share[1]


def test_pushed_epsilon_takes_effect():
    """A trainer pushes epsilon with the weights: load_state_dict changes behaviour."""
    policy = MLP(CARTPOLE, epsilon=0.0, seed=3)
    td = root(CARTPOLE, 4000)
    greedy = policy.q_values(td["observation"]).argmax(-1)
    state = policy.state_dict()
    state["epsilon"] = torch.tensor(1.0)
    policy.load_state_dict(state)
    assert float(policy.epsilon) == 1.0
    assert (policy(td)["action"] != greedy).float().mean() > 0.35


@pytest.mark.parametrize("epsilon", [1.5, -0.1, float("nan")])
def test_a_pushed_epsilon_outside_0_1_is_refused(epsilon):
    """The daemon calls the policy's check_weights on every push: an epsilon the constructor
    would refuse must not arrive by a push either."""
    from ingestd.control.handlers import _check_policy_weights
    from ingestd.errors import BadWeights

    policy = MLP(CARTPOLE, seed=3)
    state = mlp_qnet(CARTPOLE, epsilon=0.25).state_dict()
    _check_policy_weights(policy, state)  # in range: accepted
    assert float(state["epsilon"]) == 0.25
    state["epsilon"] = torch.tensor(epsilon)
    with pytest.raises(BadWeights, match="the policy refused them: epsilon must be in \\[0, 1\\]"):
        _check_policy_weights(policy, state)


@pytest.mark.parametrize("hidden, names", [
    ((64, 64), ["epsilon", "net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias", "net.4.weight", "net.4.bias"]),
    ((32,), ["epsilon", "net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]),
    ((), ["epsilon", "net.0.weight", "net.0.bias"]),
])
def test_state_dict_names_are_stable(hidden, names):
    state = MLP(CARTPOLE, hidden=hidden).state_dict()
    assert list(state) == names
    assert state["epsilon"].dtype == torch.float32 and state["epsilon"].shape == ()
    sizes = [4, *hidden, 2]
    for k, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        assert state[f"net.{2 * k}.weight"].shape == (n_out, n_in)


@pytest.mark.parametrize("spec, build", [
    (CARTPOLE, lambda: mlp_qnet(CARTPOLE, hidden=(32, 32))),
    (CARTPOLE, lambda: mlp_qnet(4, 2, hidden=(32, 32))),
    (PIXELS, lambda: mlp_qnet(PIXELS, hidden=(32, 32))),
])
def test_mlp_qnet_weights_load_into_the_policy(spec, build):
    qnet = build()
    policy = MLP(spec, hidden=(32, 32), seed=0)
    assert isinstance(qnet, QNetwork) and not isinstance(qnet, MLP)
    trainer_state = qnet.state_dict()
    assert {k: (v.shape, v.dtype) for k, v in trainer_state.items()} == \
        {k: (v.shape, v.dtype) for k, v in policy.state_dict().items()}
    policy.load_state_dict(trainer_state)
    td = root(spec, 64)
    q = qnet(td["observation"])
    assert q.requires_grad  # the trainer's network learns
    assert torch.allclose(policy.q_values(td["observation"]), q.detach())
    assert torch.equal(policy(td)["action"], q.argmax(-1))


def test_mlp_seed_fixes_weights_without_touching_global_rng():
    before = torch.get_rng_state()
    a, b = MLP(CARTPOLE, seed=4), MLP(CARTPOLE, seed=4)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(MLP(CARTPOLE, seed=5).state_dict()["net.0.weight"], a.state_dict()["net.0.weight"])


@pytest.mark.parametrize("kwargs", [{"epsilon": 1.5}, {"epsilon": -0.1}, {"hidden": (0,)}])
def test_bad_mlp_kwargs_are_rejected(kwargs):
    with pytest.raises(ValueError):
        MLP(CARTPOLE, **kwargs)


def test_a_compiled_mlp_explores_as_the_eager_one_in_one_graph_without_a_warning(caplog):
    """workers.compile_policy: `float(self.epsilon)` used to break the graph, with torch's warning
    in the daemon's log at every worker start; exploration now runs outside the graph, from the
    same seeded stream, and a pushed epsilon still takes effect."""
    import logging

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = MLP(CARTPOLE, epsilon=0.5, seed=3), MLP(CARTPOLE, epsilon=0.5, seed=3)
    act = torch.compile(compiled, dynamic=False, backend="eager")  # dynamo's tracing is what matters here
    obs = root(CARTPOLE, 256)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert torch.equal(eager(obs.clone())["action"], act(obs.clone())["action"])
        for policy in (eager, compiled):
            policy.load_state_dict({**policy.state_dict(), "epsilon": torch.tensor(0.0)})
        greedy = act(obs.clone())["action"]
    assert torch.equal(greedy, eager(obs.clone())["action"])
    assert torch.equal(greedy, compiled.q_values(obs["observation"]).argmax(-1))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not [r for r in caplog.records if "Graph break" in r.getMessage()], caplog.text

    class Sevens(MLP):  # a subclass's exploration is the one a compiled forward runs too
        def _explore(self, action):
            return torch.full_like(action, 7)

    assert set(torch.compile(Sevens(CARTPOLE), backend="eager")(obs.clone())["action"].tolist()) == {7}
