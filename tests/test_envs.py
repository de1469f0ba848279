"""Built-in envs: the layout contract, CartPole against gymnasium step for step,
the Gym adapter on real gymnasium, Checksum row verification, Pixels."""
from __future__ import annotations

import sys

import gymnasium
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from ingestd.collect.envs import CartPole, Checksum, Gym, Pixels, verify_fields, verify_rows
from ingestd.collect.envs.cartpole import THETA_THRESHOLD, X_THRESHOLD
from ingestd.collect.envs.checksum import MAX_LENGTH, MIN_LENGTH, mix64, tuple_hash
from ingestd.collect.interfaces import Env, EnvContext
from ingestd.collect.policies import Random
from ingestd.errors import ConfigError


def ctx(num_envs=4, seed=0, worker=0, episode_base=0) -> EnvContext:
    return EnvContext(num_envs=num_envs, seed=seed, worker=worker, episode_base=episode_base)


ENVS = {
    "CartPole": lambda c: CartPole(c),
    "Pixels": lambda c: Pixels(c, max_steps=20),
    "Checksum": lambda c: Checksum(c),
    "Gym": lambda c: Gym(c, id="CartPole-v1"),
}


def rollout(env, steps, seed=0):
    """Steps with a Random policy; yields each (transition, next_root)."""
    policy = Random(env.spec, seed=seed)
    root = env.reset()
    for _ in range(steps):
        transition, root = env.step_and_maybe_reset(policy(root))
        yield transition, root


# -- the layout every env shares ---------------------------------------------------
@pytest.mark.parametrize("name", list(ENVS))
def test_layout_shapes_dtypes_and_flags(name):
    n = 5
    env = ENVS[name](ctx(num_envs=n))
    spec = env.spec
    assert isinstance(env, Env) and env.num_envs == n
    root = env.reset()
    assert root.batch_size == (n,)
    assert root["observation"].shape == (n, *spec.observation_shape)
    assert root["observation"].dtype == spec.observation_dtype
    saw_done = False
    for transition, nxt_root in rollout(env, 60):
        nxt = transition["next"]
        assert nxt["observation"].shape == (n, *spec.observation_shape)
        assert nxt["observation"].dtype == spec.observation_dtype
        assert nxt["reward"].shape == (n, 1) and nxt["reward"].dtype == torch.float32
        for key in ("done", "terminated", "truncated"):
            assert nxt[key].shape == (n, 1) and nxt[key].dtype == torch.bool
            assert nxt_root[key].shape == (n, 1) and not nxt_root[key].any()
        assert torch.equal(nxt["done"], nxt["terminated"] | nxt["truncated"])
        assert transition["action"].shape == (n, *spec.action_shape)
        running = ~nxt["done"].view(-1)
        assert torch.equal(nxt_root["observation"][running], nxt["observation"][running])
        saw_done |= bool(nxt["done"].any())
    assert saw_done
    env.close()


@pytest.mark.parametrize("name", list(ENVS))
def test_same_seed_same_rollout(name):
    runs = [[t["next", "observation"].clone() for t, _ in rollout(ENVS[name](ctx(seed=7)), 30)] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("name", ["CartPole", "Pixels", "Checksum"])
def test_step_returns_the_input_td_as_the_transition(name):
    env = ENVS[name](ctx(num_envs=3))
    root = Random(env.spec, seed=0)(env.reset())
    transition = env.step(root)
    assert transition is root and set(transition["next"].keys()) >= {"observation", "reward", "done"}


# -- CartPole vs gymnasium CartPole-v1 ----------------------------------------------
def balancing(state: np.ndarray) -> np.ndarray:
    x, x_dot, theta, theta_dot = state.T
    return (10 * theta + 2 * theta_dot + 0.1 * x + 0.5 * x_dot > 0).astype(np.int64)


def test_cartpole_matches_gymnasium_step_for_step():
    """Each step both start from the same state (our float64 state copied into
    gymnasium) and take the same action; half the sub-envs balance (reaching the
    500-step truncation), half act randomly (terminating often)."""
    n, steps = 8, 1100
    env = CartPole(ctx(num_envs=n, seed=3))
    gyms = [gymnasium.make("CartPole-v1") for _ in range(n)]
    for g in gyms:
        g.reset(seed=0)
    rng = np.random.default_rng(0)
    root, totals = env.reset(), {"terminated": 0, "truncated": 0}
    for _ in range(steps):
        state, elapsed = env.state.numpy(), env.steps.numpy()
        action = rng.integers(0, 2, n)
        action[: n // 2] = balancing(state[: n // 2])
        expected = []
        for g, s, k, a in zip(gyms, state, elapsed, action):
            g.unwrapped.state, g.unwrapped.steps_beyond_terminated = s.copy(), None
            g._elapsed_steps = int(k)  # the TimeLimit wrapper's counter
            expected.append(g.step(int(a)))
        root["action"] = torch.from_numpy(action)
        transition, root = env.step_and_maybe_reset(root)
        nxt = transition["next"]
        obs, reward, term, trunc = (np.array(col) for col in list(zip(*expected))[:4])
        np.testing.assert_allclose(nxt["observation"].numpy(), obs, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(nxt["reward"].numpy()[:, 0], reward)
        np.testing.assert_array_equal(nxt["terminated"].numpy()[:, 0], term)
        np.testing.assert_array_equal(nxt["truncated"].numpy()[:, 0], trunc)
        totals["terminated"] += int(term.sum())
        totals["truncated"] += int(trunc.sum())
    assert totals["terminated"] > 20 and totals["truncated"] >= n // 2


def test_cartpole_final_observation_and_reset_distribution():
    env = CartPole(ctx(num_envs=64, seed=1))
    first = env.reset()["observation"]
    assert first.abs().max() <= 0.05 and first.std() > 0.01
    for transition, root in rollout(env, 40):
        term = transition["next", "terminated"].view(-1)
        if term.any():
            final = transition["next", "observation"][term]
            out = (final[:, 0].abs() > X_THRESHOLD) | (final[:, 2].abs() > THETA_THRESHOLD)
            assert out.all()
            assert root["observation"][term].abs().max() <= 0.05
            return
    pytest.fail("no CartPole episode terminated in 40 random steps")


def test_cartpole_truncates_at_max_steps():
    env = CartPole(ctx(num_envs=3), max_steps=500)
    root = env.reset()
    env.set_state(torch.zeros(3, 4, dtype=torch.float64), steps=torch.tensor([498, 10, 499]))
    root["action"] = torch.tensor([0, 1, 0])
    transition, root = env.step_and_maybe_reset(root)
    assert transition["next", "truncated"].view(-1).tolist() == [False, False, True]
    assert not transition["next", "terminated"].any()
    assert env.steps.tolist() == [499, 11, 0]


# -- Gym adapter ----------------------------------------------------------------------
def test_gym_final_observation_goes_to_next_and_reset_to_root():
    env = Gym(ctx(num_envs=4, seed=5), id="CartPole-v1")
    assert env.spec.observation_shape == (4,) and env.spec.num_actions == 2
    assert env.spec.action_shape == () and env.spec.action_dtype == torch.int64
    for transition, root in rollout(env, 200):
        term = transition["next", "terminated"].view(-1)
        if term.any():
            final = transition["next", "observation"][term]
            assert ((final[:, 0].abs() > X_THRESHOLD) | (final[:, 2].abs() > THETA_THRESHOLD)).all()
            assert root["observation"][term].abs().max() <= 0.05
            break
    else:
        pytest.fail("no episode terminated")
    env.close()


def test_gym_truncation_is_not_termination():
    env = Gym(ctx(num_envs=3), id="CartPole-v1", max_episode_steps=5)
    flags = [(t["next", "terminated"].view(-1).tolist(), t["next", "truncated"].view(-1).tolist())
             for t, _ in rollout(env, 10)]
    assert flags[4] == ([False] * 3, [True] * 3) and flags[9] == ([False] * 3, [True] * 3)
    assert not any(any(tr) for _, tr in flags[:4] + flags[5:9])


def test_gym_box_actions_bring_their_bounds():
    spec = Gym(ctx(), id="Pendulum-v1").spec
    assert (spec.action_shape, spec.action_low, spec.action_high) == ((1,), (-2.0,), (2.0,))
    assert Gym(ctx(), id="CartPole-v1").spec.action_low is None


def test_gym_rejects_unsupported_spaces():
    with pytest.raises(ValueError, match="not supported"):
        Gym(ctx(), id="Blackjack-v1")  # Tuple observation space


def test_gym_dict_observations_are_row_keys_of_their_own():
    """A goal-conditioned env (Dict observation space): "observation" is what the policy reads,
    the other entries are root and next keys; at an episode's end next holds the final entries
    and the root the reset ones (the adapter refused Dict spaces)."""
    env = Gym(ctx(num_envs=2), id="gym_goal_env:Goal-v0")
    assert env.spec.observation_shape == (2,) and env.spec.action_shape == (2,)
    root = env.reset()
    extra = {"achieved_goal": torch.float32, "desired_goal": torch.float32, "phase": torch.int64}
    assert {k: root[k].dtype for k in extra} == extra and root["achieved_goal"].shape == (2, 1)
    ended = 0
    for transition, root in rollout(env, 7):
        nxt = transition["next"]
        step, episode = nxt["observation"][:, 0], nxt["observation"][:, 1]
        assert (nxt["achieved_goal"][:, 0] == step).all() and (nxt["desired_goal"][:, 0] == episode).all()
        assert (nxt["phase"] == step.long() % 3).all()
        assert (transition["achieved_goal"][:, 0] == step - 1).all()  # the root it acted on: one step before
        done = nxt["terminated"].view(-1)
        if done.any():
            ended += 1
            assert (step[done] == 3).all()  # the final entries, not the reset ones
            assert (root["achieved_goal"][done] == 0).all() and (root["desired_goal"][done, 0] == episode[done] + 1).all()
    assert ended == 2
    env.close()


def test_gym_dict_observation_key_picks_the_entry_the_policy_reads():
    env = Gym(ctx(num_envs=2), id="gym_goal_env:Goal-v0", main="state", observation_key="state")
    root = env.reset()
    assert env.spec.observation_shape == (2,) and "state" not in root.keys()
    assert set(root.keys()) >= {"observation", "achieved_goal", "desired_goal", "phase"}
    env.close()
    with pytest.raises(ConfigError, match="entry 'observation' would overwrite a row key"):
        Gym(ctx(), id="gym_goal_env:Goal-v0", observation_key="desired_goal")  # two "observation"s


@pytest.mark.parametrize("kwargs, key, message", [
    ({"main": "state"}, "workers.env_kwargs", "none named 'observation'; set env_kwargs.observation_key"),
    ({"nested": True}, "workers.env", "entry 'inner'.*flatten it with a wrapper"),
    ({"clash": True}, "workers.env", "entry 'done' would overwrite a row key"),
    ({"wrappers": "gymnasium.wrappers:ClipReward"}, "workers.env_kwargs", "wrappers must be a list"),
    ({"wrappers": [{"path": "nowhere:Wrap"}]}, "workers.env_kwargs", r"wrappers\[0\]: bad import path 'nowhere:Wrap'"),
    ({"wrappers": [{"path": "gymnasium.wrappers:ClipReward", "kwargs": {"maxx": 1}}]}, "workers.env_kwargs",
     r"wrappers\[0\]: ClipReward got unknown keyword arguments \['maxx'\]"),
    ({"wrappers": [{"path": "gymnasium.wrappers:ClipReward", "args": [1]}]}, "workers.env_kwargs",
     r"wrappers\[0\] must be \{ path"),
])
def test_gym_refuses_bad_dict_spaces_and_wrappers_naming_the_key(kwargs, key, message):
    with pytest.raises(ConfigError, match=message) as err:
        Gym(ctx(), id="gym_goal_env:Goal-v0", **kwargs)
    assert err.value.key == key


def test_gym_info_keys_store_scalar_infos_under_next_with_the_final_steps_at_episode_ends():
    """A goal-conditioned user's is_success was dropped with every other info (custom-env review);
    env_kwargs.info_keys stores the named ones. At an episode's end the step's info is gymnasium's
    final_info (the top-level infos are the reset's by then)."""
    env = Gym(ctx(num_envs=2), id="gym_goal_env:Goal-v0", info_keys={"is_success": "bool", "dist": "float32"})
    ended = 0
    for transition, _ in rollout(env, 7):
        nxt = transition["next"]
        step = nxt["observation"][:, 0]
        assert nxt["is_success"].dtype == torch.bool and nxt["is_success"].shape == (2, 1)
        assert bool((nxt["is_success"].view(-1) == (step == 3)).all()), (step, nxt["is_success"])
        assert bool((nxt["dist"].view(-1) == 3 - step).all())
        ended += int(nxt["terminated"].any())
    assert ended == 2
    env.close()


@pytest.mark.parametrize("info_keys, message", [
    ({"is_success": "boolean"}, r"info_keys.is_success = 'boolean'"),
    ({"done": "bool"}, r"info_keys.done = 'bool'"),
    ({"phase": "int64"}, r"info_keys \['phase'\] are observation entries too"),
    (["is_success"], "info_keys must be a table"),
])
def test_gym_refuses_bad_info_keys_naming_env_kwargs(info_keys, message):
    with pytest.raises(ConfigError, match=message) as err:
        Gym(ctx(), id="gym_goal_env:Goal-v0", info_keys=info_keys)
    assert err.value.key == "workers.env_kwargs"


def test_gym_observation_key_is_for_dict_spaces_only():
    with pytest.raises(ConfigError, match="observation_key picks an entry of a Dict observation space") as err:
        Gym(ctx(), id="CartPole-v1", observation_key="state")
    assert err.value.key == "workers.env_kwargs"


def test_gym_wrappers_wrap_every_sub_env_in_order():
    """env_kwargs.wrappers: import paths, or { path, kwargs } tables, applied to each sub-env in order."""
    env = Gym(ctx(num_envs=3), id="gym_goal_env:Goal-v0", length=5,
              wrappers=[{"path": "gymnasium.wrappers:ClipReward", "kwargs": {"max_reward": 2.5}},
                        "gymnasium.wrappers:FlattenObservation"])
    assert env.spec.observation_shape == (7,)  # achieved 1 + desired 1 + observation 2 + phase one-hot 3
    rewards = [t["next", "reward"].view(-1).tolist() for t, _ in rollout(env, 4)]
    assert rewards == [[1.0] * 3, [2.0] * 3, [2.5] * 3, [2.5] * 3]
    env.close()


@pytest.mark.parametrize("kwargs", [{}, {"idd": "Pendulum-v1"}, {"id": 3}])
def test_gym_needs_an_id(kwargs):
    """Without an id the adapter made CartPole-v1: a typo'd key failed as "CartPoleEnv got an
    unexpected keyword argument 'idd'", and a missing one ran the wrong env."""
    with pytest.raises(ConfigError, match="needs env_kwargs.id") as err:
        Gym(ctx(), **kwargs)
    assert err.value.key == "workers.env_kwargs"


def test_gym_without_gymnasium_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # makes `import gymnasium` fail
    with pytest.raises(ImportError, match=r"pip install 'ingestd\[gym\]'"):
        Gym(ctx())


# -- Checksum ----------------------------------------------------------------------------
def worker_rows(num_envs=6, worker=3, episode_base=1000, steps=150) -> TensorDict:
    """Rows as a worker stamps them: episode + num_envs on done, step back to 0."""
    env = Checksum(ctx(num_envs=num_envs, worker=worker, episode_base=episode_base))
    policy = Random(env.spec, seed=0)
    stamps = {"worker": torch.full((num_envs,), worker), "env": torch.arange(num_envs),
              "episode": episode_base + torch.arange(num_envs), "step": torch.zeros(num_envs, dtype=torch.int64)}
    root, rows = env.reset(), []
    for _ in range(steps):
        for field, value in stamps.items():
            root.set(("ingestd", field), value)
        transition, root = env.step_and_maybe_reset(policy(root))
        rows.append(transition.clone())
        done = transition["next", "done"].view(-1)
        stamps["episode"] = stamps["episode"] + done * num_envs
        stamps["step"] = torch.where(done, 0, stamps["step"] + 1)
    return torch.cat(rows)


def test_checksum_worker_rows_verify_with_both_endings():
    rows = worker_rows()
    assert verify_rows(rows).all()
    assert rows["next", "terminated"].any() and rows["next", "truncated"].any()
    ends = rows["next", "done"].view(-1)
    lengths = rows["ingestd", "step"][ends] + 1
    assert MIN_LENGTH <= lengths.min() and lengths.max() <= MAX_LENGTH
    assert rows["observation"][:, 0].eq(3).all() and rows["ingestd", "episode"].min() == 1000


def _bump(t: torch.Tensor) -> torch.Tensor:
    return ~t if t.dtype == torch.bool else t + 1


@pytest.mark.parametrize("key", [
    "observation", "checksum", "done", "terminated", "truncated",
    ("next", "observation"), ("next", "reward"), ("next", "checksum"),
    ("next", "done"), ("next", "terminated"), ("next", "truncated"),
    ("ingestd", "worker"), ("ingestd", "env"), ("ingestd", "episode"), ("ingestd", "step"),
])
def test_checksum_detects_any_corrupted_field(key):
    rows = worker_rows(steps=40)
    for row in range(0, rows.shape[0], 7):
        bad = rows.clone()
        leaf = bad.get(key)
        leaf[row] = _bump(leaf[row].clone())
        ok = verify_rows(bad)
        assert not ok[row], f"corrupting {key} in row {row} went unnoticed"
        assert ok.sum() == rows.shape[0] - 1


def test_checksum_detects_invalid_action_torn_and_foreign_rows():
    rows = worker_rows(steps=40)
    bad = rows.clone()
    bad["action"][0] = 2  # the action is free, but must be a valid one
    torn = rows.clone()  # the next half of another row of the same worker
    torn["next"][1] = rows["next"][50].clone()
    foreign = worker_rows(worker=4, steps=40)  # another worker's row, stamped as ours
    foreign.set("ingestd", rows["ingestd"].clone())
    zeros = torch.zeros_like(rows[:3])  # a never-written (zero-filled) row
    assert not verify_rows(bad)[0] and not verify_rows(torn)[1]
    assert not verify_rows(foreign).any() and not verify_rows(zeros).any()
    assert not verify_fields(torn)["next.observation"][1]


def test_checksum_hash_is_splitmix64():
    """A pure function of the bits (checked against a Python reference), so the same
    in every process; Python's salted hash() plays no part."""
    def splitmix64(v: int) -> int:
        m = (1 << 64) - 1
        z = (v + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    values = [0, 1, 2, 12345, -1, -(1 << 63), (1 << 63) - 1]
    got = [v & ((1 << 64) - 1) for v in mix64(torch.tensor(values)).tolist()]
    assert got == [splitmix64(v & ((1 << 64) - 1)) for v in values]
    here = tuple_hash(torch.tensor(3), torch.tensor(5), torch.tensor(1000), torch.arange(4))
    assert len(set(here.tolist())) == 4


def test_checksum_full_reset_starts_new_episodes():
    env = Checksum(ctx(num_envs=2, episode_base=10))
    assert env.reset()["observation"][:, 2].tolist() == [10, 11]  # sub-env i: episode_base + i
    assert env.reset()["observation"][:, 2].tolist() == [12, 13]  # then + num_envs each


# -- Pixels --------------------------------------------------------------------------------
def test_pixels_is_atari_shaped_and_ends_both_ways():
    n, max_steps = 16, 30
    env = Pixels(ctx(num_envs=n, seed=2), max_steps=max_steps)
    assert (env.spec.observation_shape, env.spec.observation_dtype, env.spec.num_actions) == \
        ((4, 84, 84), torch.uint8, 6)
    term = trunc = 0
    steps = torch.zeros(n, dtype=torch.int64)
    previous = env.reset()["observation"]
    for transition, root in rollout(env, 120):
        nxt = transition["next"]
        assert nxt["observation"].shape == (n, 4, 84, 84) and nxt["observation"].dtype == torch.uint8
        assert not torch.equal(nxt["observation"], previous)
        previous = root["observation"]
        steps += 1
        truncated, done = nxt["truncated"].view(-1), nxt["done"].view(-1)
        assert steps[truncated].eq(max_steps).all() and steps[done].le(max_steps).all()
        assert steps.le(max_steps).all()
        steps[done] = 0
        term += int(nxt["terminated"].sum())
        trunc += int(truncated.sum())
    assert term > 0 and trunc > 0


@pytest.mark.parametrize("factory, kwargs", [
    (CartPole, {"max_steps": 0}), (Pixels, {"max_steps": 0}), (Pixels, {"tape_frames": 2}),
])
def test_bad_env_kwargs_are_rejected(factory, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        factory(ctx(), **kwargs)


def test_a_torch_env_returning_int_flags_stores_bool_ones_and_resets():
    """A TorchEnv subclass returning int32 terminated/truncated: the auto-reset's mask failed
    at the first episode end (torch.where wants bool; custom-env review). The base stores the
    layout's bool flags and resets the finished sub-envs."""
    from ingestd.collect.envs.base import TorchEnv
    from ingestd.collect.interfaces import EnvSpec

    class Counting(TorchEnv):
        def __init__(self, ctx):
            super().__init__(ctx, EnvSpec((1,), torch.float32, (), torch.int64, 2))
            self.t = torch.zeros(ctx.num_envs)

        def _reset(self, mask):
            self.t = torch.where(mask, 0.0, self.t) if mask is not None else torch.zeros_like(self.t)
            return self.t[:, None].clone()

        def _step(self, action):
            self.t = self.t + 1
            ended = (self.t >= 2).to(torch.int32)
            return self.t[:, None].clone(), torch.ones(self.num_envs), ended, torch.zeros_like(ended), {}

    env = Counting(ctx(num_envs=3))
    root = env.reset()
    for _ in range(4):
        transition, root = env.step_and_maybe_reset(root.set("action", torch.zeros(3, dtype=torch.int64)))
        for key in ("done", "terminated", "truncated"):
            assert transition.get(("next", key)).dtype == torch.bool
    assert transition.get(("next", "terminated")).all() and (root.get("observation") == 0).all()
