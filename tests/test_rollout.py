"""The rollout's chunks: rolled into private buffers or straight into the storage's reserved slots."""
from __future__ import annotations

import math

import pytest
import torch

from ingestd.collect.envs.base import TorchEnv
from ingestd.collect.envs.pixels import Pixels
from ingestd.collect.interfaces import EnvContext, EnvSpec
from ingestd.collect.policies import Random
from ingestd.collect.rollout import Rollout
from ingestd.replay import ReplayReader, ReplayStorage

STEPS, ENVS = 4, 8
IMAGES = (("observation",), ("next", "observation"))


def pixels_rollout(seed: int = 3) -> Rollout:
    env = Pixels(EnvContext(num_envs=ENVS, seed=seed, worker=1, episode_base=5 << 32), max_steps=3)
    return Rollout(env, Random(env.spec, seed=seed), 1, 5 << 32, STEPS)


def flat(td) -> dict:
    return {k: v.clone() for k, v in td.items(include_nested=True, leaves_only=True)}


def assert_same_rows(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_rows_rolled_into_given_tensors_equal_the_buffered_ones():
    buffered, direct = pixels_rollout(), pixels_rollout()
    into = {key: torch.full((STEPS * ENVS, 4, 84, 84), 7, dtype=torch.uint8) for key in IMAGES}
    for version in range(3):  # episodes of 3 steps: resets inside and across chunks
        expected, finished = buffered.chunk(version)
        rows, got_finished = direct.chunk(version, into=into)
        assert_same_rows(flat(rows), flat(expected))
        assert (got_finished.returns, got_finished.lengths) == (finished.returns, finished.lengths)
        for key in IMAGES:
            assert rows.get(key).data_ptr() == into[key].data_ptr()  # the rows are the given tensors
        rows, _ = direct.chunk(version)  # and without into, its own buffers again
        assert all(rows.get(key).data_ptr() != into[key].data_ptr() for key in IMAGES)
        buffered.chunk(version)


def test_image_buffers_are_made_only_for_a_chunk_that_cannot_go_into_slots():
    """A 64-step x 64-env Pixels chunk's two image buffers are 231 MB: a rollout whose chunks
    all go into the storage's slots never makes them; the first chunk that cannot (a
    reservation wrapping the ring) does, and its rows are exact."""
    buffered, direct = pixels_rollout(), pixels_rollout()
    into = {key: torch.zeros(STEPS * ENVS, 4, 84, 84, dtype=torch.uint8) for key in IMAGES}
    for version in range(2):
        rows, _ = direct.chunk(version, into=into)
        assert_same_rows(flat(rows), flat(buffered.chunk(version)[0]))
    assert all(direct._leaves[key if len(key) > 1 else key[0]] is None for key in IMAGES)
    rows, _ = direct.chunk(2)  # no slots: the buffers now
    assert_same_rows(flat(rows), flat(buffered.chunk(2)[0]))
    assert all(direct._leaves[key if len(key) > 1 else key[0]] is not None for key in IMAGES)


class _Wrapped:
    """An ``ENVS``-env CartPole whose transitions a subclass changes (``steps``: steps taken)."""

    def __init__(self):
        from ingestd.collect.envs.cartpole import CartPole

        self.inner = CartPole(EnvContext(num_envs=ENVS, seed=0, worker=0, episode_base=0))
        self.num_envs, self.spec, self.steps = ENVS, self.inner.spec, 0

    def reset(self):
        return self.inner.reset()


class _WideFeature(_Wrapped):
    """CartPole plus a float leaf of 8,192 values per sub-env (256 KB a step: copied step by
    step like an image, yet 32 KB a row: scanned for NaN), NaN at step ``bad``."""

    def __init__(self, bad: int):
        super().__init__()
        self.bad = bad

    def step_and_maybe_reset(self, td):
        transition, root = self.inner.step_and_maybe_reset(td)
        feature = torch.zeros(ENVS, 8192)
        if self.steps == self.bad:
            feature[3, 5] = float("nan")
        self.steps += 1
        transition.set(("next", "feature"), feature)
        return transition, root


class _WideReward(_WideFeature):
    """CartPole whose reward has 2,048 components per sub-env (a storage column: given slots
    may hold it), summing to the step's reward."""

    def step_and_maybe_reset(self, td):
        transition, root = self.inner.step_and_maybe_reset(td)
        reward = transition.get(("next", "reward"))
        transition.set(("next", "reward"), (reward / 2048).expand(ENVS, 2048).clone())
        return transition, root


def test_returns_and_flags_of_leaves_rolled_into_given_tensors_are_counted():
    """Review: with a reward rolled into given slots (a reward that is a storage column), the
    episode accounting read the rollout's own reward buffer, never filled: returns of 0."""
    buffered, direct = (Rollout(e, Random(e.spec, seed=0), 0, 0, STEPS) for e in (_WideReward(0), _WideReward(0)))
    into = {("next", "reward"): torch.zeros(STEPS * ENVS, 2048)}
    ended = 0
    for version in range(8):
        want, want_done = buffered.chunk(version)
        got, got_done = direct.chunk(version, into=into)
        assert got.get(("next", "reward")).data_ptr() == into[("next", "reward")].data_ptr()
        assert got_done.lengths == want_done.lengths and got_done.returns == pytest.approx(want_done.returns)
        ended += len(got_done.returns)
    assert ended and all(r > 1 for r in got_done.returns + want_done.returns if r)


def test_a_leaf_large_per_step_but_small_per_row_is_still_scanned_for_nan():
    from ingestd.errors import EnvFault

    env = _WideFeature(bad=STEPS + 1)
    rollout = Rollout(env, Random(env.spec, seed=0), 0, 0, STEPS)
    rows, _ = rollout.chunk(0)
    assert rows.get(("next", "feature")).shape == (STEPS * ENVS, 8192)
    with pytest.raises(EnvFault, match=r"non-finite \('next', 'feature'\)"):
        rollout.chunk(0)


@pytest.mark.parametrize("bad", ["shape", "dtype", "not contiguous"])
def test_unfit_targets_are_not_used(bad):
    make = {"shape": lambda: torch.zeros(STEPS * ENVS - 1, 4, 84, 84, dtype=torch.uint8),
            "dtype": lambda: torch.zeros(STEPS * ENVS, 4, 84, 84, dtype=torch.int16),
            "not contiguous": lambda: torch.zeros(4, STEPS * ENVS, 84, 84, dtype=torch.uint8).transpose(0, 1)}[bad]
    buffered, direct = pixels_rollout(), pixels_rollout()
    into = {key: make() for key in IMAGES}
    rows, _ = direct.chunk(0, into=into)
    assert_same_rows(flat(rows), flat(buffered.chunk(0)[0]))
    assert (into[IMAGES[0]] == 0).all()


def test_chunks_rolled_into_reserved_slots_are_stored_exactly(shm_dir):
    buffered, direct = pixels_rollout(), pixels_rollout()
    example, _ = pixels_rollout().chunk(0)
    capacity = 3 * STEPS * ENVS - 8  # the third chunk wraps around the ring: no views, copied at commit
    with ReplayStorage.create(shm_dir / "r", example, capacity) as store, ReplayReader(shm_dir / "r") as reader:
        for version in range(3):
            with store.reserved(direct.rows_per_chunk) as slots:
                assert bool(slots.columns) == (version < 2)
                rows, _ = direct.chunk(version, into=slots.columns)
                slots.commit(rows)
            expected, _ = buffered.chunk(version)
            got = reader.gather([(slots.first + i) % capacity for i in range(slots.n)])
            want = flat(expected)
            assert_same_rows({k: v for k, v in flat(got).items() if k in want}, want)


# the rewards of Noisy: float32 draws in [-1, 2) (not exact in binary), and half of them -0.0
# (a return of -0.0s alone is 0.0, as from 0.0 step by step)
REWARDS = {
    "floats": lambda draw: draw,
    "floats and -0.0": lambda draw: torch.where(draw < 0.5, -0.0, draw),
}


class Noisy(TorchEnv):
    """Random rewards (``REWARDS``) and random episode ends, both ways."""

    def __init__(self, ctx: EnvContext, rewards: str = "floats"):
        super().__init__(ctx, EnvSpec((2,), torch.float32, (), torch.int64, 2))
        self.rewards = REWARDS[rewards]

    def _reset(self, mask):
        return torch.zeros(self.num_envs, 2)

    def _step(self, action):
        draw = torch.rand(3, self.num_envs, generator=self._gen)
        return torch.zeros(self.num_envs, 2), self.rewards(draw[0] * 3 - 1), draw[1] < 0.1, draw[2] < 0.05, {}


class DoneAs:
    """An env whose transitions carry ``("next", "done")`` in another layout than TorchRL's."""

    def __init__(self, env, convert):
        self.env, self.convert = env, convert
        self.num_envs, self.spec = env.num_envs, env.spec

    def reset(self):
        return self.env.reset()

    def step_and_maybe_reset(self, td):
        transition, root = self.env.step_and_maybe_reset(td)
        transition.set(("next", "done"), self.convert(transition.get(("next", "done"))))
        return transition, root


DONE_LAYOUTS = {
    "bool [B, 1]": None,
    "uint8 [B, 1]": lambda done: done.to(torch.uint8),
    "bool [B]": lambda done: done.view(-1),
    "bool [B, 2]": lambda done: torch.cat((torch.zeros_like(done), done), dim=1),
}


class Regrowing:
    """An env whose extra leaf changes its width every chunk: the rollout makes new buffers each time."""

    def __init__(self, env, chunk_steps: int):
        self.env, self.chunk_steps, self.calls = env, chunk_steps, 0
        self.num_envs, self.spec = env.num_envs, env.spec

    def reset(self):
        return self.env.reset()

    def step_and_maybe_reset(self, td):
        transition, root = self.env.step_and_maybe_reset(td)
        width = 1 + (self.calls // self.chunk_steps) % 2
        transition.set(("next", "extra"), torch.zeros(self.num_envs, width))
        self.calls += 1
        return transition, root


@pytest.mark.parametrize("rewards", REWARDS)
@pytest.mark.parametrize("regrow", [False, True], ids=["same buffers", "new buffers every chunk"])
@pytest.mark.parametrize("steps", [1, 7])
@pytest.mark.parametrize("layout", DONE_LAYOUTS)
def test_stamps_and_finished_episodes_match_a_step_by_step_account(layout, steps, regrow, rewards):
    envs, base = 5, 9 << 32
    env = Noisy(EnvContext(num_envs=envs, seed=11, worker=2, episode_base=base), rewards)
    if DONE_LAYOUTS[layout] is not None:
        env = DoneAs(env, DONE_LAYOUTS[layout])
    if regrow:
        env = Regrowing(env, steps)
    rollout = Rollout(env, Random(env.spec, seed=1), 2, base, steps)
    ret, step, episode = [0.0] * envs, [0] * envs, [base + i for i in range(envs)]
    total_finished = 0
    for version in range(42 // steps):
        rows, finished = rollout.chunk(version)
        rows = rows.reshape(steps, envs)
        returns, lengths = [], []
        for t in range(steps):
            for i in range(envs):
                row = rows[t, i]
                stamps = [int(row["ingestd", f]) for f in ("worker", "env", "episode", "step", "policy_version")]
                assert stamps == [2, i, episode[i], step[i], version]
                ret[i] = ret[i] + float(row["next", "reward"])  # float64, in step order
                step[i] += 1
                if bool(row["next", "done"].any()):
                    returns.append(ret[i])
                    lengths.append(step[i])
                    ret[i], step[i], episode[i] = 0.0, 0, episode[i] + envs
        assert (finished.returns, finished.lengths) == (returns, lengths)  # exactly
        assert [math.copysign(1, r) for r in finished.returns] == [math.copysign(1, r) for r in returns]  # 0.0s
        total_finished += len(returns)
    assert total_finished > 10


class OwnIngestdKeys:
    """An env that reads the root's stamps if any, and puts its own leaves under ``"ingestd"``."""

    def __init__(self, env):
        self.env, self.num_envs, self.spec = env, env.num_envs, env.spec
        self.saw_stamps = False

    def reset(self):
        return self.env.reset()

    def step_and_maybe_reset(self, td):
        self.saw_stamps |= "ingestd" in td.keys()
        transition, root = self.env.step_and_maybe_reset(td)
        transition.set(("ingestd", "step"), torch.full((self.num_envs,), -7, dtype=torch.int64))
        transition.set(("ingestd", "tag"), torch.full((self.num_envs,), 5, dtype=torch.int64))
        return transition, root


def test_the_env_does_not_see_the_stamps_and_its_own_ingestd_leaves_keep_or_yield():
    """The stamps are set on the rows after the chunk (Env's contract): an env's leaf of a stamp's
    name yields to the stamp, any other leaf under "ingestd" is stored as it is."""
    env = OwnIngestdKeys(Noisy(EnvContext(num_envs=3, seed=1, worker=0, episode_base=0)))
    rollout = Rollout(env, Random(env.spec, seed=1), 0, 0, 4)
    rows, _ = rollout.chunk(0)
    assert not env.saw_stamps
    assert rows["ingestd", "step"].view(4, 3)[:, 0].tolist() != [-7] * 4
    assert rows["ingestd", "step"].min() >= 0 and rows["ingestd", "tag"].eq(5).all()


def test_episode_ids_are_unique_over_sub_envs_workers_and_incarnations():
    """Each sub-env numbered its episodes from the same base: 8 sub-envs shared one id, and a
    trainer grouping rows by episode (TorchRL's traj_ids) merged different episodes."""
    from ingestd.collect.envs.checksum import Checksum
    from ingestd.collect.interfaces import episode_base_of

    owners: dict[int, set] = {}
    for worker, incarnation in ((0, 1), (1, 2), (0, 3)):  # worker 0 restarted as incarnation 3
        base = episode_base_of(incarnation)
        env = Checksum(EnvContext(num_envs=ENVS, seed=incarnation, worker=worker, episode_base=base))
        rollout = Rollout(env, Random(env.spec, seed=0), worker, base, STEPS)
        for _ in range(30):  # Checksum episodes last 3..40 steps: many end per sub-env
            rows, _ = rollout.chunk(0)
            for episode, env_index in zip(rows["ingestd", "episode"].tolist(), rows["ingestd", "env"].tolist()):
                owners.setdefault(episode, set()).add((incarnation, env_index))
    assert len(owners) > 3 * ENVS * 2  # several episodes per sub-env
    assert all(len(o) == 1 for o in owners.values()), "an episode id was used by two sub-envs"


def test_a_policy_module_with_grad_acts_under_no_grad():
    """Workers act under torch.no_grad() as TorchRL's collectors do: a SAC actor written as a
    plain nn.Module built an autograd graph every step, and the gym adapter failed on its
    actions ("Can't call numpy() on Tensor that requires grad")."""
    from ingestd.collect.envs import Gym

    env = Gym(EnvContext(num_envs=2, seed=0, worker=0, episode_base=0), id="Pendulum-v1")
    actor = torch.nn.Linear(3, 1)

    def policy(td):
        td.set("action", torch.tanh(actor(td.get("observation"))) * 2)
        return td
    try:
        rows, _ = Rollout(env, policy, worker=0, episode_base=0, chunk_steps=4).chunk(0)
    finally:
        env.close()
    assert rows["action"].shape == (8, 1) and not rows["action"].requires_grad


class _SometimesKey(_Wrapped):
    """CartPole whose transitions gain ``("next", "late")`` from step ``at`` on."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def step_and_maybe_reset(self, td):
        transition, root = self.inner.step_and_maybe_reset(td)
        self.steps += 1
        if self.steps > self.at:
            transition.set(("next", "late"), torch.zeros(ENVS, 1))
        return transition, root


def test_a_key_the_env_sets_only_sometimes_is_named_with_its_step():
    """The error said "the env's transitions do not all have the same keys" and named nothing
    (custom-env review): it now names the key, whether new or missing, the step, and workers.env."""
    _refused_in_the_first_chunk(_SometimesKey(at=2), r"changed their keys at step 2 of a chunk: new "
                                                     r"\[\('next', 'late'\)\], missing \[\]")


def _refused_in_the_first_chunk(env, message: str, steps: int = STEPS) -> None:
    """``env``'s first chunk raises ``EnvFault`` matching ``message``, naming workers.env."""
    from ingestd.errors import EnvFault

    rollout = Rollout(env, Random(env.spec, seed=0), 0, 0, steps)
    with pytest.raises(EnvFault, match=message) as err:
        rollout.chunk(0)
    assert err.value.key == "workers.env"


class _InPlaceFrames:
    """Pixels-like frames kept in one buffer the env rolls in place and returns every step (the
    frame-stacker habit); ``fresh`` returns a copy instead."""

    def __init__(self, fresh: bool | str, frame: tuple = (4, 8)):
        self.num_envs, self.fresh, self.t = ENVS, fresh, 0
        self.spec = EnvSpec(frame, torch.uint8, (), torch.int64, num_actions=2)
        self.stack = torch.zeros((ENVS, *frame), dtype=torch.uint8)

    def _root(self, copy: bool = False):
        from tensordict import TensorDict
        obs = self.stack.clone() if self.fresh is True or copy else self.stack
        flags = {k: torch.zeros(ENVS, 1, dtype=torch.bool) for k in ("done", "terminated", "truncated")}
        return TensorDict({"observation": obs, **flags}, batch_size=[ENVS])

    def reset(self):
        return self._root()

    def step_and_maybe_reset(self, td):
        self.t += 1
        if self.fresh != "constant":  # "constant": the one buffer, handed out again and never written
            self.stack.copy_(torch.roll(self.stack, -1, dims=1))
            self.stack[:, -1] = self.t
        root = self._root()
        nxt = self._root(copy=True) if self.fresh == "root only" else root.clone(recurse=False)
        nxt.set("reward", torch.zeros(ENVS, 1))
        td.set("next", nxt)
        return td, root

    def close(self):
        pass


@pytest.mark.parametrize("fresh", [False, True, "constant"])
def test_an_env_overwriting_a_buffer_it_returned_is_refused(fresh):
    """Every row stored observation == next observation, bit for bit, without an error, when the
    env rolled its frame stack in place and returned the buffer itself (pixel-DQN review). A
    tensor handed out again unchanged (a constant goal or observation) is fine."""
    from ingestd.errors import EnvFault

    env = _InPlaceFrames(fresh)
    rollout = Rollout(env, Random(env.spec, seed=0), 0, 0, STEPS)
    if fresh == "constant":
        for _ in range(3):  # past the checked chunks
            rows, _ = rollout.chunk(0)
        assert bool((rows["next", "observation"] == 0).all() and (rows["observation"] == 0).all())
        return
    if fresh:
        rows, _ = rollout.chunk(0)
        assert bool((rows["next", "observation"][:, -1] == rows["observation"][:, -1] + 1).all())
        return
    with pytest.raises(EnvFault, match=r"wrote step values into the tensor it had returned for .observation. and returned it again as \(.next., .observation.\)"):
        rollout.chunk(0)


@pytest.mark.parametrize("frame, steps", [((4, 84, 84), STEPS), ((4, 8), 1)], ids=["image", "small, 1-step chunks"])
def test_an_env_overwriting_the_root_it_steps_from_is_refused(frame, steps):
    """Rollout fuzz: a frame stack rolled in its buffer, handed out as the root observation and
    copied as the next one, stored observation == next observation without an error: for an
    image (copied after the step) and, with one step a chunk, for a small leaf."""
    _refused_in_the_first_chunk(_InPlaceFrames("root only", frame),
                                r"wrote into the tensor it had returned for 'observation' while stepping from it", steps)


class _LateDtype(_SometimesKey):
    """CartPole with an ``("next", "id")`` leaf: int32 until step ``at``, int64 (past int32) after."""

    def step_and_maybe_reset(self, td):
        transition, root = self.inner.step_and_maybe_reset(td)
        self.steps += 1
        late = self.steps > self.at
        transition.set(("next", "id"), torch.full((ENVS, 1), 2 ** 40 + self.steps if late else self.steps,
                                                  dtype=torch.int64 if late else torch.int32))
        return transition, root


def test_a_small_leaf_changing_dtype_within_a_chunk_is_refused_not_cast():
    """Rollout fuzz: stacked into the buffer made from the chunk's first step, an int64 leaf was
    stored as int32 (2**40 + 3 as 3), a float64 reward rounded to float32, without an error."""
    _refused_in_the_first_chunk(_LateDtype(at=2), r"changed \('next', 'id'\) within a chunk: \(8, 1\) "
                                                  r"torch.int32, then \(8, 1\) torch.int64")


class _StampThenKey(_Wrapped):
    """CartPole that sets its own ``("ingestd", "step")`` in the first chunk (the stamp wins),
    and instead a new ``("next", "y")`` from the second chunk on: as many leaves."""

    def step_and_maybe_reset(self, td):
        transition, root = self.inner.step_and_maybe_reset(td)
        self.steps += 1
        key = ("ingestd", "step") if self.steps <= STEPS else ("next", "y")
        transition.set(key, torch.full((ENVS, 1) if key[0] == "next" else (ENVS,), 7))
        return transition, root


def test_a_new_key_in_place_of_one_named_like_a_stamp_is_stored():
    """Rollout fuzz: the buffers made for the first chunk were taken to fit (as many leaves,
    and every known key there), so ("next", "y") was never stored."""
    env = _StampThenKey()
    rollout = Rollout(env, Random(env.spec, seed=0), 0, 0, STEPS)
    first, _ = rollout.chunk(0)
    assert ("next", "y") not in first.keys(True) and first["ingestd", "step"].max() < STEPS
    second, _ = rollout.chunk(0)
    assert bool((second["next", "y"] == 7).all())


def test_a_reward_of_several_components_is_summed_in_float64():
    """Rollout fuzz: float16 components of 40,000 summed to inf in float16, and finite rewards
    then gave infinite returns."""
    from ingestd.collect.rollout import _rewards_into

    out = torch.empty(2, 3, dtype=torch.float64)
    _rewards_into(out, torch.full((2, 3, 2), 40000.0, dtype=torch.float16))
    assert bool((out == 80000.0).all())


def test_a_constant_nan_or_a_moved_tensor_is_not_taken_for_an_in_place_write():
    from ingestd.collect.rollout import _changed_values

    goal = torch.tensor([1.0, float("nan")])
    assert not _changed_values(goal, goal.clone())  # NaN == NaN here: the same constant
    odd = torch.complex(torch.tensor([float("nan")]), torch.tensor([1.0]))  # review: a complex NaN was "changed"
    assert not _changed_values(odd, odd.clone()) and _changed_values(odd, odd.clone() + 1j)
    assert _changed_values(goal, torch.tensor([2.0, float("nan")]))
    assert not _changed_values(goal, goal.to(torch.float64))  # not the memory that was copied


class _ReusedReward(_SometimesKey):
    """CartPole whose reward is one buffer the env writes each step's reward into (``constant``:
    the buffer is handed out again unchanged)."""

    def __init__(self, constant: bool):
        super().__init__(at=10 ** 9)
        self.constant, self.buf = constant, torch.zeros(ENVS, 1)

    def step_and_maybe_reset(self, td):
        transition, root = self.inner.step_and_maybe_reset(td)
        self.steps += 1
        if not self.constant:
            self.buf.fill_(self.steps)
        transition.set(("next", "reward"), self.buf)
        return transition, root


@pytest.mark.parametrize("constant", [False, True])
def test_a_small_leaf_buffer_reused_across_steps_is_refused(constant):
    """Second review: a reward (or any small leaf) buffer the env writes into and returns every
    step passed the root/next check, and every stored row held the chunk's last reward."""
    from ingestd.errors import EnvFault

    env = _ReusedReward(constant)
    rollout = Rollout(env, Random(env.spec, seed=0), 0, 0, STEPS)
    if constant:
        rows, _ = rollout.chunk(0)
        assert bool((rows["next", "reward"] == 0).all())
        return
    with pytest.raises(EnvFault, match=r"same tensor memory for \('next', 'reward'\) at two steps of a chunk") as err:
        rollout.chunk(0)
    assert err.value.key == "workers.env"


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16], ids=["numpy's copy", "torch's (no numpy dtype)"])
def test_large_leaves_are_copied_into_their_rows_whatever_their_dtype_and_strides(dtype):
    from ingestd.collect.rollout import _copy_eager

    rows = torch.zeros(2, 64, 1024, dtype=dtype)
    for leaf in (torch.ones(64, 1024, dtype=dtype), torch.full((1024, 64), 2, dtype=dtype).t()):
        _copy_eager([("observation", rows.unbind(0), None)], {"observation": leaf}, 1)
        assert torch.equal(rows[1], leaf) and not rows[0].any()


@pytest.mark.parametrize("where", ["reset", "step", "policy"])
def test_an_error_raised_by_the_env_or_the_policy_names_its_config_key(where):
    """A runtime error in the user's env or policy reached the status as a bare
    ``RuntimeError: ...``: which of the two raised it, and so which key to look at, was not said."""
    from ingestd.errors import part_of

    class Env(TorchEnv):
        def __init__(self):
            super().__init__(EnvContext(num_envs=2, seed=0, worker=0, episode_base=0),
                             EnvSpec((3,), torch.float32, (), torch.int64, 2))

        def _reset(self, mask):
            if where == "reset":
                raise RuntimeError("scene missing")
            return torch.zeros(2, 3)

        def _step(self, action):
            if where == "step":
                raise RuntimeError("simulator went away")
            return torch.zeros(2, 3), torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool)

    env = Env()
    policy = Random(env.spec, seed=0)
    if where == "policy":
        def policy(root):  # noqa: F811 (a policy that fails in its forward)
            raise ValueError("bad weights")
    with pytest.raises(Exception) as raised:
        Rollout(env, policy, worker=0, episode_base=0, chunk_steps=4).chunk(0)
    assert part_of(raised.value) == ("workers.policy" if where == "policy" else "workers.env")
